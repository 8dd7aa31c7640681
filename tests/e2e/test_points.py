"""A paused workflow damaged in the store, brought back with ``restore --as-of`` on a fresh compute.

The real approval agent runs under ``sidecar run`` and pauses on ``request_info``; the wrapper's
drain writes a restore point of the paused state. Then its checkpoint files are overwritten with
garbage on disk and mirrored by another ``run`` (whose drain writes a point of the damage). On a
fresh compute (new, empty directories) ``restore --as-of`` the paused point's time fills the roots
with the paused state, and the continuation, under ``sidecar run`` again, completes.
"""

from __future__ import annotations

import datetime
import json
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
from tests.pointkit import after

pytestmark = pytest.mark.e2e

USER = "alice"


def history(store: Path, env: dict[str, str]) -> list[dict]:
    r = sidecar("history", "--json", "--store", str(store), cwd=store.parent, env=env)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def wait_past(store: Path, t: str) -> None:
    """Until the store's clock is past ``t`` (a time history printed)."""
    async def go() -> None:
        s = DirectoryStore(str(store))
        await s.open()
        await after(s, datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp())

    anyio.run(go)


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
    assert paused_checkpoint(store / ".checkpoints", response_id, call_id, USER) is not None, first.log_tail()
    [paused] = history(store, env)  # the point the wrapper's drain wrote: the paused state
    wait_past(store, paused["time"])

    # The damage: every checkpoint file overwritten with garbage on disk, and mirrored (its drain
    # writes a point of the damage too).
    damaged = sorted(p for p in (first_dir / ".checkpoints").rglob("*.json"))
    assert damaged
    for p in damaged:
        p.write_bytes(b"\x00garbage" + os.urandom(64))
    r = sidecar("run", "--http-addr", "", "--store", str(store), "--", "true", cwd=first_dir, env=env)
    assert r.returncode == 0, r.stderr
    assert paused_checkpoint(store / ".checkpoints", response_id, call_id, USER) is None, "the damage was not mirrored"
    assert [x["kind"] for x in history(store, env)] == ["incr", "full"]

    # A fresh compute: new, empty directories; the state as it was before the damage.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    r = sidecar("restore", "--store", str(store), "--as-of", paused["time"], cwd=fresh, env=env)
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
