"""A paused workflow damaged in the store, brought back with ``restore --as-of`` on a fresh compute.

The real approval agent runs under ``sidecar run`` and pauses on ``request_info``; the wrapper's
drain writes a restore point of the paused state. Then its checkpoint files are overwritten with
garbage on disk and mirrored by another ``run`` (whose drain writes a point of the damage). On a
fresh compute (new, empty directories) ``restore --as-of`` the paused point's time fills the roots
with the paused state, and the continuation, under ``sidecar run`` again, completes.

On the issue stack (one file per checkpoint) and on today's stack (state under
``$AGENTSERVER_STATE_ROOT``), on a directory and on Azure (Azurite).
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
from sidecar.store.registry import make_store
from tests.e2e.stacks import Stack, StoreView, disk_files
from tests.e2e.test_recovery import APPROVED, assert_approved
from tests.pointkit import after

pytestmark = pytest.mark.e2e

USER = "alice"

#: The stacks and stores the restore story runs on: the issue stack, and the stack a plain
#: install resolves today on both stores.
STACKS_AND_STORES = pytest.mark.parametrize(
    "stack,view",
    [("issue", "directory"), ("today", "directory"), pytest.param("today", "azure", marks=pytest.mark.azure)],
    indirect=True,
)


def history(view: StoreView, cwd: Path, env: dict[str, str]) -> list[dict]:
    r = sidecar("history", "--json", "--store", view.url, cwd=cwd, env=env)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def wait_past(view: StoreView, t: str) -> None:
    """Until the store's clock is past ``t`` (a time history printed)."""
    async def go() -> None:
        s = make_store(view.url, env=view.env)
        try:
            await s.open()
            await after(s, datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp())
        finally:
            await s.aclose()

    anyio.run(go)


def sidecar(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], cwd=cwd, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


@STACKS_AND_STORES
def test_restore_as_of_before_the_damage_resumes_on_a_fresh_compute(tmp_path, stack: Stack, view: StoreView,
                                                                       start_host, sidecar_cli):
    wrapper = [sys.executable, "-m", "sidecar", "run", "--http-addr", "", "--store", view.url, "--"]
    env = {**sidecar_cli, **view.env, **stack.env}
    first_dir = tmp_path / "first"
    first_dir.mkdir()
    first = start_host(first_dir, stack.python, wrapper=wrapper, env=env, ready_timeout=60)
    response_id, call_id = first.first_request(user=USER)
    assert first.stop(signal.SIGTERM) == 0, first.log_tail()
    assert stack.holds_pause(view.files(), response_id, call_id, USER), first.log_tail()
    [paused] = history(view, tmp_path, env)  # the point the wrapper's drain wrote: the paused state
    wait_past(view, paused["time"])

    # The damage: every checkpoint file overwritten with garbage on disk, and mirrored (its drain
    # writes a point of the damage too).
    damaged = stack.checkpoint_keys(disk_files(first_dir, stack.roots), response_id, USER)
    assert damaged
    for key in damaged:
        (first_dir / key).write_bytes(b"\x00garbage" + os.urandom(64))
    r = sidecar("run", "--http-addr", "", "--store", view.url, "--", "true", cwd=first_dir, env=env)
    assert r.returncode == 0, r.stderr
    assert not stack.holds_pause(view.files(), response_id, call_id, USER), "the damage was not mirrored"
    assert [x["kind"] for x in history(view, tmp_path, env)] == ["incr", "full"]

    # A fresh compute: new, empty directories; the state as it was before the damage.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    r = sidecar("restore", "--store", view.url, "--as-of", paused["time"], cwd=fresh, env=env)
    assert r.returncode == 0, r.stderr
    assert stack.holds_pause(disk_files(fresh, stack.roots), response_id, call_id, USER)

    second = start_host(fresh, stack.python, wrapper=wrapper, env=env, ready_timeout=60)
    outcome = second.continue_(response_id, call_id, user=USER)
    assert_approved(outcome, second)
    assert outcome.text == APPROVED
    assert second.stop(signal.SIGTERM) == 0, second.log_tail()
    # the sidecar mirrored the restored disk back: the store holds no garbage any more
    wait_for(lambda: not any(v.startswith(b"\x00garbage") for v in view.files().values()), 20,
             "the store to hold the restored state", second.log_tail)
