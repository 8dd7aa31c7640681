"""Shared test helpers: polls with deadlines, tree snapshots, a sidecar process under test."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent


def wait_for(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition",
             diagnostics: Callable[[], str] = lambda: "", interval: float = 0.01):
    """Poll ``cond`` until it returns something truthy (returned); after ``timeout`` s fail with
    ``what`` and whatever ``diagnostics()`` adds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{diagnostics()}")
        time.sleep(interval)


def json_lines(text: str) -> list[dict]:
    """The JSON objects among ``text``'s lines (the sidecar's JSON log lines), other lines skipped."""
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def metric_values(text: str) -> dict[str, float]:
    """Every sample of a Prometheus exposition (labels folded into the name), after a strict parse."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def disk_tree(root: Path) -> dict[str, bytes]:
    """Regular files under ``root`` (symlinks and *.tmp skipped) by relative path."""
    out = {}
    if not root.exists():
        return out
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            if p.is_symlink() or f.endswith(".tmp") or f.startswith(".sidecar-"):
                continue
            try:
                out[str(p.relative_to(root))] = p.read_bytes()
            except FileNotFoundError:  # replaced or removed while we looked
                continue
    return out


def seed_directory_store(store: Path, files: dict[str, bytes], mtime_ns: int = 1_700_000_000_000_000_000) -> None:
    """Put ``files`` (key → bytes) into the directory store at ``store``, as a sync would have."""
    import anyio

    from sidecar.store.base import ObjectMeta
    from sidecar.store.directory import DirectoryStore

    async def seed() -> None:
        s = DirectoryStore(str(store))
        await s.open()
        try:
            for key, data in files.items():
                await s.put(key, data, ObjectMeta.of(data, mtime_ns, 0o600))
        finally:
            await s.aclose()

    anyio.run(seed)


def checkpoints_root_with_a_link_out(tmp_path: Path):
    """``tmp_path/w/.checkpoints`` (a Root) whose ``ctx`` is a symlink to ``tmp_path/outside``."""
    from sidecar.paths import Root

    outside = tmp_path / "outside"
    outside.mkdir()
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    os.makedirs(root.path)
    os.symlink(outside, os.path.join(root.path, "ctx"))
    return root, outside


def store_tree(store: Path, root_name: str = ".checkpoints") -> dict[str, bytes]:
    """What the directory store holds for one root, in the same shape as :func:`disk_tree`."""
    return disk_tree(store / root_name)


def write_atomic(path: Path, data: bytes) -> None:
    """As the agent host writes: temp file beside the target, then os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def remove_root(path: Path) -> None:
    """A root gone as a whole at once, as a volume that went away: renamed out of place, then
    removed. (An ``rm -rf`` slower than the uploader's delete settle may mirror the deletes of
    its first files, docs/MIRRORING.md; a test of the vanished-root rule must not race that.)"""
    gone = path.with_name(f".{path.name}.gone-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, gone)
    shutil.rmtree(gone)


def sidecar_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["SIDECAR_LOG_FORMAT"] = "json"
    env["SIDECAR_HTTP_ADDR"] = ""
    env["SIDECAR_FENCE_MARGIN"] = "1"  # a restarted sidecar waits out its predecessor's window; keep it short
    env.update(extra)
    return env


def sidecar_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sidecar", *args]


class Sidecar:
    """``checkpoint-sidecar sync`` (or run) as a real process, its JSON log captured to a file."""

    def __init__(self, cwd: Path, *args: str, env: dict[str, str] | None = None, log: Path | None = None,
                 wrap: list[str] | tuple[str, ...] = ()):
        self.cwd = Path(cwd)
        self.log_path = log or self.cwd.parent / f"sidecar-{time.monotonic_ns()}.log"
        self.logf = open(self.log_path, "wb")  # noqa: SIM115  (the child's log while it runs)
        self.proc = subprocess.Popen(
            [*wrap, *sidecar_cmd(*args)], cwd=cwd, env=env or sidecar_env(), stdout=self.logf, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def events(self) -> list[dict]:
        return json_lines(self.log_path.read_text(errors="replace"))

    def has_event(self, name: str) -> bool:
        return any(e.get("event") == name for e in self.events())

    def wait_event(self, name: str, timeout: float = 15.0) -> dict:
        def find():
            if self.proc.poll() is not None and not self.has_event(name):
                raise AssertionError(f"sidecar exited {self.proc.returncode} before {name!r}:\n{self.log()}")
            return next((e for e in self.events() if e.get("event") == name), None)

        return wait_for(find, timeout, f"log event {name!r}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        self.send(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.logf.close()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.logf.close()


#: Runs a command as root without the capabilities that bypass file permissions, so that a
#: ``chmod 000`` directory is as unreadable to the sidecar as another user's would be.
WITHOUT_DAC = ("setpriv", "--bounding-set=-dac_override,-dac_read_search")


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60,
            wrap: list[str] | tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*wrap, *sidecar_cmd(*args)], cwd=cwd, env=env or sidecar_env(), capture_output=True, text=True,
                          timeout=timeout)
