"""Every setting a command applies is one it takes (a flag): each one-shot command runs against a
real directory store with its settings wrapped so that every read of a setting is recorded."""

from __future__ import annotations

import anyio
import pytest

from sidecar import lifecycle
from sidecar.cli import COMMAND_SETTINGS, build_parser
from sidecar.config import SETTING_NAMES, Settings, load
from sidecar.ops import status

#: Properties of Settings and the settings they are made of.
DERIVED = {"namespace": {"prefix", "session_namespace"}, "http_host_port": {"http_addr"}}


class Recording:
    """``settings`` as the command sees it, noting which settings it reads."""

    def __init__(self, settings: Settings) -> None:
        object.__setattr__(self, "_settings", settings)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name: str) -> object:
        if name in SETTING_NAMES:
            self.read.add(name)
        self.read.update(DERIVED.get(name, ()))
        return getattr(self._settings, name)


def applied(tmp_path, command: str) -> set[str]:
    work = tmp_path / "work"
    (work / ".checkpoints").mkdir(parents=True)
    settings, roots = load({}, cwd=str(work), env={"SIDECAR_STORE": str(tmp_path / "store"), "HOME": str(tmp_path),
                                                   "SIDECAR_HTTP_ADDR": ""})
    (tmp_path / "store").mkdir()
    rec = Recording(settings)
    run = {"restore": lambda: lifecycle.restore(rec, roots),  # type: ignore[arg-type]
           "status": lambda: status.command(rec, roots, True),  # type: ignore[arg-type]
           "release": lambda: lifecycle.release(rec, roots)}[command]  # type: ignore[arg-type]
    assert anyio.run(run) in (0, 1)
    return rec.read


@pytest.mark.parametrize("command", ["restore", "status", "release"])
def test_every_setting_a_command_applies_is_one_it_takes(tmp_path, command, capsys):
    read = applied(tmp_path, command)
    assert read, "nothing recorded"
    assert read <= set(COMMAND_SETTINGS[command]), f"{command} applies {sorted(read - set(COMMAND_SETTINGS[command]))}"


def test_restore_takes_max_file_size():
    args = build_parser().parse_args(["restore", "--max-file-size", "1024", "--ignore", "*.tmp"])
    assert args.max_file_size == "1024" and args.ignore == "*.tmp"
