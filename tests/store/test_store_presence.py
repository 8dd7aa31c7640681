"""A store that is not there is an error, never an empty answer (issue #34, item 3), in process, on
both stores: ``status``, ``history``, ``restore --as-of`` and ``release`` on a mistyped directory or
a missing container exit 1 with one line naming the store, and create nothing; a plain
``restore`` (an init container's, before the first ``sync`` creates the store) starts empty and
says so in one line. Read-only commands never write to a directory store, not even a probe of its
clock: they say in one line that this machine's clock is used."""

from __future__ import annotations

import pytest

from sidecar import lifecycle
from sidecar.config import load
from sidecar.ops import history, sessions, status
from sidecar.points.plan import AsOf
from sidecar.store import registry
from sidecar.store.base import ObjectMeta
from tests.pointkit import write_point

pytestmark = pytest.mark.anyio

NS = "agents/s1"


@pytest.fixture
def missing_place(store_place, tmp_path):
    """A store URL that names nothing (a directory never made; a container never created) and its
    credentials."""
    url, creds = store_place
    if "://" not in url:
        url = str(tmp_path / "no-such-store")
    return url, creds


@pytest.fixture
def settings_at(monkeypatch, tmp_path):
    """``settings_at(url, creds, **variables)``: what a command loads for that store, from an
    empty working directory."""
    for k in ("FOUNDRY_AGENT_SESSION_ID", "FOUNDRY_AGENT_NAME"):
        monkeypatch.delenv(k, raising=False)

    def make(url: str, creds: dict, **variables: str):
        for k, v in creds.items():
            monkeypatch.setenv(k, v)
        work = tmp_path / "work"
        work.mkdir(exist_ok=True)
        env = {"HOME": str(tmp_path), "SIDECAR_STORE": url, "SIDECAR_PREFIX": NS, **variables}
        return load({}, cwd=str(work), env=env)

    return make


async def store_is_there(url: str, creds: dict) -> bool:
    store = registry.make_store(url, "", read_only=True, env=creds)
    try:
        return await store.exists()
    finally:
        await store.aclose()


COMMANDS = {
    "status": lambda s, r: status.command(s, r, False),
    "history": lambda s, r: history.command(s, False),
    "restore --as-of 1h": lambda s, r: lifecycle.restore(s, r, AsOf(ago=3600.0)),
    "restore --as-of TIME": lambda s, r: lifecycle.restore(s, r, AsOf(when=1_700_000_000.0)),
    "release": lambda s, r: lifecycle.release(s, r),
    "release --force": lambda s, r: lifecycle.release(s, r, True),
}


@pytest.mark.parametrize("command", list(COMMANDS))
async def test_a_store_that_is_not_there_is_one_line_and_exit_1(command, missing_place, settings_at, capsys):
    url, creds = missing_place
    settings, roots = settings_at(url, creds)
    assert await COMMANDS[command](settings, roots) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "the store " in lines[0] and " is not there: check SIDECAR_STORE" in lines[0], lines[0]
    assert url.rstrip("/").rsplit("/", 1)[-1] in lines[0] and "Traceback" not in err
    assert "in sync" not in out and "nothing to release" not in out
    assert not await store_is_there(url, creds)

    # once the store is there (the namespace still empty), the same command does not say so
    made = registry.make_store(url, "elsewhere", env=creds)
    await made.open()
    await made.aclose()
    await COMMANDS[command](settings, roots)
    assert "is not there" not in capsys.readouterr().err


def events(caplog, event: str) -> list[dict]:
    """The fields of every ``event`` logged (in process, the log is Python's)."""
    return [r.fields for r in caplog.records if r.getMessage() == event]  # type: ignore[attr-defined]


async def test_a_plain_restore_of_a_store_that_is_not_there_starts_empty_and_says_so(missing_place, settings_at,
                                                                                     caplog):
    """An init container's restore on a new deployment runs before the first sync creates the
    store: it is not an error, but a mistyped store is named all the same."""
    url, creds = missing_place
    settings, roots = settings_at(url, creds)
    assert await lifecycle.restore(settings, roots) == 0
    said = events(caplog, "store_not_there")
    assert len(said) == 1 and "the first sync or run creates it" in said[0]["detail"], said
    assert url.rstrip("/").rsplit("/", 1)[-1] in said[0]["store"]
    assert not await store_is_there(url, creds)


@pytest.fixture
def clock_probes(monkeypatch):
    """Every probe of the directory store's clock (a temp file made in the store), counted."""
    from sidecar.store import directory

    made: list[int] = []
    real = directory._clock_at

    def counted(dfd: int, close: bool = False) -> float:
        made.append(dfd)
        return real(dfd, close)

    monkeypatch.setattr(directory, "_clock_at", counted)
    return made


async def test_read_only_commands_write_no_clock_probe_and_say_the_clock_is_local(tmp_path, settings_at,
                                                                                   clock_probes, caplog, capsys):
    url = str(tmp_path / "store")
    store = registry.make_store(url, NS)
    await store.open()
    data = b"{}"
    await store.put(".checkpoints/a.json", data, ObjectMeta.of(data, 1, 0o600, version=1))
    await write_point(store, 100)
    await store.aclose()
    settings, roots = settings_at(url, {})

    assert await lifecycle.restore(settings, roots, AsOf(ago=0.0)) == 0, capsys.readouterr().err
    assert await sessions.command(settings, False, 3600.0) == 0
    assert clock_probes == []
    told = events(caplog, "store_clock_local")
    assert len(told) == 1 and "this machine's clock is used" in told[0]["detail"] and "only reads" in told[0]["detail"], told
