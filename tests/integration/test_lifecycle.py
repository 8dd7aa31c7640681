"""``sync``'s start-up and stop, in process, with the injectable shutdown trigger (as a signal
would pull it) and the directory store."""

from __future__ import annotations

import anyio

from sidecar import lifecycle
from sidecar.config import load
from sidecar.daemon import Daemon, Occasion
from sidecar.errors import EXIT_FAIL, EXIT_OK
from sidecar.lifecycle import Shutdown
from support import store_tree, write_atomic


def test_a_stop_while_mirroring_starts_still_drains_what_the_first_scan_queued(tmp_path, monkeypatch):
    """SIGTERM after the restore, while the first scan runs (a pod deleted just after it started):
    what the host wrote meanwhile is queued by that scan and must be flushed, exit 0."""
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    write_atomic(cps / "ctx" / "a.json", b"written while the sidecar started")
    settings, roots = load({"store": str(tmp_path / "store"), "roots": str(cps), "http_addr": ""}, cwd=str(work))
    shutdown = Shutdown()
    real_reconcile = Daemon.reconcile

    async def reconcile(self, **kw):
        if kw.get("occasion") is Occasion.INITIAL:
            shutdown.trigger("SIGTERM")
        return await real_reconcile(self, **kw)

    monkeypatch.setattr(Daemon, "reconcile", reconcile)
    assert anyio.run(lifecycle.sync, settings, roots, shutdown) == EXIT_OK
    assert store_tree(tmp_path / "store") == {"ctx/a.json": b"written while the sidecar started"}


def test_a_stop_during_the_restore_ends_it_without_serving(tmp_path, monkeypatch):
    """The control: a stop while restoring ends the start-up at once (exit 1), nothing mirrored."""
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    write_atomic(cps / "ctx" / "a.json", b"a")
    settings, roots = load({"store": str(tmp_path / "store"), "roots": str(cps), "http_addr": ""}, cwd=str(work))
    shutdown = Shutdown()
    served = []

    async def prepare(daemon):
        shutdown.trigger("SIGTERM")
        await anyio.sleep_forever()

    monkeypatch.setattr(Daemon, "prepare", prepare)
    monkeypatch.setattr(Daemon, "serve", lambda *a, **k: served.append(1))
    assert anyio.run(lifecycle.sync, settings, roots, shutdown) == EXIT_FAIL
    assert served == []
    assert store_tree(tmp_path / "store") == {}
