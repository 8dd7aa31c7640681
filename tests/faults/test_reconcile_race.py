"""A periodic reconcile racing live writes (found by the soak: Azure runs logged
``reconcile_found_changes`` with deletes for files that were on disk).

The local rescan walks the disk in a worker thread while uploads go on. A file created after the
walk passed its directory, and stored before the walk ends, is in what the store is known to hold
but not in the scan: the reconcile must not queue a delete for it (the store would lose a live
checkpoint until a later reconcile put it back). Deterministic: the scan is wrapped so that exactly
this happens while it runs.
"""

from __future__ import annotations

import anyio
import pytest

import sidecar.daemon as daemon_mod
from sidecar.config import load
from sidecar.daemon import Daemon
from sidecar.queue import DELETE
from sidecar.store import make_store
from sidecar.store.base import ObjectInfo, ObjectMeta
from support import write_atomic

pytestmark = pytest.mark.faults


def test_a_file_stored_while_the_scan_runs_is_not_deleted(tmp_path, monkeypatch):
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    write_atomic(cps / "ctx" / "old.json", b"old")
    settings, roots = load({"store": str(tmp_path / "store"), "roots": str(cps)}, cwd=str(work))
    daemon = Daemon(settings, roots, make_store(settings.store))
    daemon.build()  # what serve() builds: the uploader the reconcile queues into
    old = ".checkpoints/ctx/old.json"
    new = ".checkpoints/ctx/new.json"
    st = (cps / "ctx" / "old.json").stat()
    daemon.known.stored(old, ObjectInfo(old, 3, ObjectMeta.of(b"old", st.st_mtime_ns, 0).sha256,
                                        st.st_mtime_ns, st.st_mode & 0o7777))
    real_scan = daemon_mod.scan_root

    def scan_racing_a_write(root, ignore, *gaps):
        files, links = real_scan(root, ignore, *gaps)  # the walk has passed ctx/ ...
        write_atomic(cps / "ctx" / "new.json", b"new")  # ... the host writes a checkpoint there ...
        nst = (cps / "ctx" / "new.json").stat()
        daemon.known.stored(new, ObjectInfo(new, 3, ObjectMeta.of(b"new", nst.st_mtime_ns, 0).sha256,
                                            nst.st_mtime_ns, nst.st_mode & 0o7777))  # ... and it is stored
        return files, links

    monkeypatch.setattr(daemon_mod, "scan_root", scan_racing_a_write)
    anyio.run(daemon.reconcile)
    queued = daemon.uploader.pending.pending
    assert not (new in queued and queued[new].kind == DELETE), "a delete was queued for a file that is on disk"


def test_a_file_rewritten_while_the_scan_passes_is_not_deleted(tmp_path, monkeypatch):
    """Unlinked and written again (not an atomic replace) while the walk passes its directory, and
    the new version stored before the scan ends: absent from the scan, known before it, on disk."""
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    state = cps / "ctx" / "state.json"
    write_atomic(state, b"v1")
    settings, roots = load({"store": str(tmp_path / "store"), "roots": str(cps)}, cwd=str(work))
    daemon = Daemon(settings, roots, make_store(settings.store))
    daemon.build()  # what serve() builds: the uploader the reconcile queues into
    key = ".checkpoints/ctx/state.json"

    def stored(data: bytes) -> ObjectInfo:
        st = state.stat()
        return ObjectInfo(key, len(data), ObjectMeta.of(data, st.st_mtime_ns, 0).sha256, st.st_mtime_ns,
                          st.st_mode & 0o7777)

    daemon.known.stored(key, stored(b"v1"))
    real_scan = daemon_mod.scan_root

    def scan_racing_a_rewrite(root, ignore, *gaps):
        state.unlink()  # the host unlinks ...
        files, links = real_scan(root, ignore, *gaps)  # ... the walk passes ctx/ ...
        write_atomic(state, b"v2")  # ... the host writes it again ...
        daemon.known.stored(key, stored(b"v2"))  # ... and the watcher's upload of it is done
        return files, links

    monkeypatch.setattr(daemon_mod, "scan_root", scan_racing_a_rewrite)
    anyio.run(daemon.reconcile)
    queued = daemon.uploader.pending.pending
    assert key not in queued, f"{queued[key].kind} queued for a file that is on disk"


def test_a_stored_file_that_is_really_gone_is_still_deleted(tmp_path):
    """The control: the same reconcile deletes a stored file with nothing on disk, a symlink, or a
    file reached through a symlinked directory (never mirrored: the scan does not follow links)."""
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    write_atomic(cps / "ctx" / "kept.json", b"k")
    (cps / "ctx" / "link.json").symlink_to(cps / "ctx" / "kept.json")
    write_atomic(tmp_path / "elsewhere" / "x.json", b"outside the root")
    (cps / "moved").symlink_to(tmp_path / "elsewhere")  # a stored directory replaced by a link
    settings, roots = load({"store": str(tmp_path / "store"), "roots": str(cps)}, cwd=str(work))
    daemon = Daemon(settings, roots, make_store(settings.store))
    daemon.build()  # what serve() builds: the uploader the reconcile queues into
    for name in ("ctx/gone.json", "ctx/link.json", "moved/x.json"):
        key = f".checkpoints/{name}"
        daemon.known.stored(key, ObjectInfo(key, 1, ObjectMeta.of(b"x", 1, 0).sha256, 1, 0o600))
    anyio.run(daemon.reconcile)
    queued = daemon.uploader.pending.pending
    assert {k: op.kind for k, op in queued.items() if op.kind == DELETE} == {
        ".checkpoints/ctx/gone.json": DELETE, ".checkpoints/ctx/link.json": DELETE,
        ".checkpoints/moved/x.json": DELETE}
