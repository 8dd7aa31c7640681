"""A new session's files are in a restore point as soon as changes settle (issue #33, item 4), in
process, on every store: a namespace empty at start, its roots there but empty, points
every 0.2 s and no periodic reconcile. The host writes files; a point holding exactly them
exists while the sidecar still runs, long before its drain.

The old rule kept a root empty at start out of every point until a periodic reconcile saw its
files (never with ``SIDECAR_RECONCILE_INTERVAL=0``), so the only point was an empty full one."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from support import write_atomic
from tests.inprocess import InProcess, run_sync, settings_for
from tests.pointkit import newest_tree

pytestmark = pytest.mark.anyio


async def test_a_new_sessions_files_are_in_a_point_once_changes_settle(make_store, tmp_path):
    store = await make_store("")
    work = tmp_path / "work"
    for name in (".checkpoints", ".function_approvals"):
        (work / name).mkdir(parents=True)  # both roots there, and empty, at start
    settings, roots = settings_for(work, str(tmp_path / "unused"), restore_point_interval=0.2,
                                   reconcile_interval=0)
    wrote = {".checkpoints/ctx/cp-1.json": b'{"step": 1}', ".checkpoints/ctx/cp-2.json": b'{"step": 2}',
             ".function_approvals/a.json": b'{"approved": true}'}

    async def host(life: InProcess) -> None:
        for key, data in wrote.items():
            write_atomic(Path(work, key), data)
        with anyio.move_on_after(30):  # settled: every file in a point, the sidecar still running
            while (tree := await newest_tree(store)) != wrote:
                await anyio.sleep(0.02)  # a poll's pace
        assert tree == wrote, f"no point of the new session's files in 30 s; the newest point held {tree}"
        assert life.daemon.ledger.kept_roots == set()  # nothing stored was kept for these roots

    assert await run_sync(InProcess(settings, roots, store), host) == 0
