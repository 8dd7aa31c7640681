"""A paused workflow damaged in the store, brought back with ``restore --as-of`` on a fresh compute.

The real approval agent runs under ``sidecar run`` and pauses on ``request_info``; a restore point
of the mirrored store is written (with the writer's encoder, from the stored objects, until the
writer writes them itself). Then its checkpoint files are overwritten with garbage on disk and
mirrored, and a point of the damaged state follows. On a fresh compute (new, empty directories)
``restore --as-of`` a time before the damage fills the roots with the paused state, and the
continuation, under ``sidecar run`` again, completes.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from agenthost import wait_for
from sidecar.store.directory import DirectoryStore
from tests.e2e.test_recovery import APPROVED, assert_approved, paused_checkpoint
from tests.pointkit import after, objects, write_point

pytestmark = pytest.mark.e2e

USER = "alice"


def point(store: Path, seq: int, keys: list[str] | None = None, **kw) -> float:
    """A point of the store's objects now (``keys``: an incremental's); its time, once passed."""
    async def go() -> float:
        s = DirectoryStore(str(store))
        await s.open()
        info = await write_point(s, seq, keys, **kw)
        await after(s, info.modified)
        return info.modified

    return anyio.run(go)


def next_seq(store: Path) -> int:
    """Above every version stored (as the writer's next version would be)."""
    async def go() -> int:
        s = DirectoryStore(str(store))
        await s.open()
        return max([i.version async for i in s.list()], default=0) + 1

    return anyio.run(go)


def stored_keys(store: Path) -> list[str]:
    async def go() -> list[str]:
        s = DirectoryStore(str(store))
        await s.open()
        return sorted(await objects(s))

    return anyio.run(go)


def sidecar(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], cwd=cwd, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


def test_restore_as_of_before_the_damage_resumes_on_a_fresh_compute(tmp_path, issue_python, start_host,
                                                                       sidecar_wrapper):
    store = tmp_path / "store"
    wrapper, env = sidecar_wrapper(store)
    first_dir = tmp_path / "first"
    first_dir.mkdir()
    first = start_host(first_dir, issue_python, wrapper=wrapper, env=env, ready_timeout=60)
    response_id, call_id = first.first_request(user=USER)
    assert first.stop(signal.SIGTERM) == 0, first.log_tail()
    good = paused_checkpoint(store / ".checkpoints", response_id, call_id, USER)
    assert good is not None, first.log_tail()
    full_seq = next_seq(store)
    before = point(store, full_seq)  # a full point of the paused state

    # The damage: every checkpoint file overwritten with garbage on disk, and mirrored.
    damaged = sorted(p for p in (first_dir / ".checkpoints").rglob("*.json"))
    assert damaged
    for p in damaged:
        p.write_bytes(b"\x00garbage" + os.urandom(64))
    r = sidecar("run", "--http-addr", "", "--store", str(store), "--", "true", cwd=first_dir, env=env)
    assert r.returncode == 0, r.stderr
    assert paused_checkpoint(store / ".checkpoints", response_id, call_id, USER) is None, "the damage was not mirrored"
    keys = [k for k in stored_keys(store) if k.startswith(".checkpoints/")]
    point(store, next_seq(store), keys, base=full_seq, prev=full_seq)  # a point of the damage too

    # A fresh compute: new, empty directories; the state as it was before the damage.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    when = datetime.datetime.fromtimestamp(before, datetime.timezone.utc).isoformat()
    r = sidecar("restore", "--store", str(store), "--as-of", when, cwd=fresh, env=env)
    assert r.returncode == 0, r.stderr
    assert paused_checkpoint(fresh / ".checkpoints", response_id, call_id, USER) is not None

    second = start_host(fresh, issue_python, wrapper=wrapper, env=env, ready_timeout=60)
    outcome = second.continue_(response_id, call_id, user=USER)
    assert_approved(outcome, second)
    assert outcome.text == APPROVED
    assert second.stop(signal.SIGTERM) == 0, second.log_tail()
    # the sidecar mirrored the restored disk back: the store holds no garbage any more
    wait_for(lambda: not any((store / ".checkpoints").rglob("*.json")) or all(
        not p.read_bytes().startswith(b"\x00garbage") for p in (store / ".checkpoints").rglob("*.json")), 20,
        "the store to hold the restored state", second.log_tail)
