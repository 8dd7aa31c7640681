"""A watcher event trailing the drain (found by tests/integration/test_fence_versions.py under
load: a ``sync`` stopped right after the host's write exited 75, "1 pending", though the write was
stored and in the final restore point).

The final rescan uploads the host's last write; inotify's event for that same write can reach the
daemon after the drain's last look (the final point written, the uploads idle). What was pending
at that look is what was left: the late duplicate must not turn a flushed drain into one that left
changes pending (exit 75, and the owner marker kept instead of released). Deterministic: the
duplicate is queued the moment the final point is written.
"""

from __future__ import annotations

import anyio
import pytest

from sidecar.config import load
from sidecar.daemon import Daemon
from sidecar.queue import UPLOAD
from sidecar.store import make_store
from support import write_atomic

pytestmark = pytest.mark.faults

KEY = ".checkpoints/ctx/state.json"


def test_a_watcher_event_after_the_drains_last_look_is_not_left_pending(tmp_path):
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    write_atomic(cps / "ctx" / "state.json", b"v1")
    settings, roots = load({"store": str(tmp_path / "store"), "roots": str(cps), "reconcile_interval": 0},
                           cwd=str(work))
    store = make_store(settings.store)
    daemon = Daemon(settings, roots, store)
    finals = []

    async def main() -> int:
        await store.open()
        await daemon.prepare()
        daemon.build()  # what serve() builds, its point writer replaced before it runs
        real_final = daemon.points.final
        written = anyio.Event()

        async def final_then_trailing_event():
            point = await real_final()
            finals.append(point)
            written.set()  # the watcher's event for the same write is delivered right after
            return point

        daemon.points.final = final_then_trailing_event  # type: ignore[method-assign]

        async def trailing_event() -> None:
            await written.wait()
            daemon.uploader.mark(KEY, UPLOAD)

        async with anyio.create_task_group() as tg:
            await tg.start(daemon.serve)
            tg.start_soon(trailing_event)
            with anyio.fail_after(10):
                while daemon.uploader.pending_keys():
                    await anyio.sleep(0.01)
            write_atomic(cps / "ctx" / "state.json", b"v2")  # the host's last write, just before the stop
            with anyio.fail_after(10, shield=True):
                left = await daemon.drain(5.0)
            tg.cancel_scope.cancel()
        await store.aclose()
        return left

    left = anyio.run(main)
    assert finals and finals[-1] is not None, "the drain wrote no final restore point"
    assert (tmp_path / "store" / KEY).read_bytes() == b"v2"
    assert left == 0, "a trailing event for a stored write counted as left pending"
