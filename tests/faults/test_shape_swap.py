"""A file↔directory swap: the host replaces the file ``a`` with a directory ``a/`` holding
``a/x`` (or a directory with a file of its name), then the compute is lost.

* The replaced objects are deleted with the change, not at the next rescan (the rescans are off
  here): the store ends up holding the new shape only, on both stores.
* Azure's namespace is flat: between the new shape's upload and the old one's delete it holds
  both. The sidecar is SIGKILLed exactly there (the proxy holds the delete), and a restore on a
  fresh compute must give the host the new shape only, never the deleted old file: it decides by
  the sidecar's version (``plan.ShapeConflicts``). The directory store cannot hold both shapes at
  once: its put of the new shape replaces the old one, so a kill right after it restores the new
  shape too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from support import Sidecar, disk_tree, run_cli, sidecar_env, store_tree, wait_for, write_atomic

pytestmark = pytest.mark.faults

NO_RESCAN = {"SIDECAR_RECONCILE_INTERVAL": "0", "SIDECAR_FULL_RECONCILE_INTERVAL": "0"}


def seed(cps: Path) -> None:
    write_atomic(cps / "a", b"the old file a")
    write_atomic(cps / "d" / "x", b"old d/x")
    write_atomic(cps / "d" / "y", b"old d/y")
    write_atomic(cps / "keep.json", b"unchanged")


def swap(cps: Path, direction: str, parked: Path) -> str:
    """Make the swap as a host would; the key of the new shape's upload."""
    if direction == "file-to-dir":
        os.unlink(cps / "a")
        write_atomic(cps / "a" / "x", b"the new a/x")
        return ".checkpoints/a/x"
    os.rename(cps / "d", parked)  # moved away: no event for d/x and d/y themselves
    write_atomic(cps / "d", b"the new file d")
    return ".checkpoints/d"


class Stores:
    """The store of one test, either kind, seen the same way."""

    def __init__(self, kind: str, tmp_path: Path, request) -> None:
        self.kind = kind
        self.target = None
        if kind == "azure":
            from tests.faults.faultkit import new_target

            self.target = new_target(request.getfixturevalue("azurite"), "swap")
            self.url = self.target.store_url
            self.env = self.target.env(**NO_RESCAN)
        else:
            self.url = str(tmp_path / "store")
            self.env = sidecar_env(**NO_RESCAN)

    def tree(self) -> dict[str, bytes] | None:
        """What the store holds for the root; None when an object vanished while it was read."""
        try:
            return self.target.tree() if self.target is not None else store_tree(Path(self.url))
        except Exception as e:  # deleted between the listing and the download: look again
            leaves = e.exceptions if isinstance(e, BaseExceptionGroup) else (e,)
            if all("BlobNotFound" in str(x) or isinstance(x, FileNotFoundError) for x in leaves):
                return None
            raise

    def drop(self) -> None:
        if self.target is not None:
            self.target.drop()


@pytest.mark.parametrize("direction", ["file-to-dir", "dir-to-file"])
@pytest.mark.parametrize("kind", ["directory", pytest.param("azure", marks=pytest.mark.azure)])
def test_a_swap_deletes_the_replaced_shape_with_the_change(kind, direction, tmp_path, request):
    stores = Stores(kind, tmp_path, request)
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    seed(cps)
    sc = Sidecar(work, "sync", "--store", stores.url, env=stores.env)
    try:
        sc.wait_event("ready", 30)
        wait_for(lambda: stores.tree() == disk_tree(cps), 30, "the seed to be stored")
        swap(cps, direction, tmp_path / "parked")
        wait_for(lambda: stores.tree() == disk_tree(cps), 30, "the store to hold the new shape only, without a rescan",
                 diagnostics=lambda: f"; store holds {sorted(stores.tree() or ())}\n{sc.log()[-4000:]}", interval=0.05)
        assert sc.stop() == 0, sc.log()[-3000:]
    finally:
        sc.kill()
        stores.drop()


def restore_fresh(stores: Stores, tmp_path: Path) -> dict[str, bytes]:
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    r = run_cli("restore", "--store", stores.url, cwd=fresh, env=stores.env)
    assert r.returncode == 0, r.stdout + r.stderr
    return disk_tree(fresh / ".checkpoints")


def sync_fresh(stores: Stores, tmp_path: Path) -> None:
    """The fresh compute's sidecar: its first reconcile deletes the stale shape it did not restore."""
    sc = Sidecar(tmp_path / "fresh", "sync", "--store", stores.url, env=stores.env)
    try:
        sc.wait_event("ready", 30)
        wait_for(lambda: stores.tree() == disk_tree(tmp_path / "fresh" / ".checkpoints"), 30,
                 "the stale shape to be deleted", diagnostics=lambda: f"; store holds {sorted(stores.tree() or ())}")
        assert sc.stop() == 0, sc.log()[-3000:]
    finally:
        sc.kill()


@pytest.mark.azure
@pytest.mark.parametrize("direction", ["file-to-dir", "dir-to-file"])
def test_a_crash_between_the_new_shapes_upload_and_the_old_ones_delete(direction, tmp_path, request):
    from tests.proxy import Proxy

    azurite = request.getfixturevalue("azurite")
    stores = Stores("azure", tmp_path, request)
    target = stores.target
    proxy = Proxy.before(azurite.url)
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    seed(cps)
    sc = Sidecar(work, "sync", "--store", proxy.via(target.store_url), env=target.env(proxy.via(azurite.url), **NO_RESCAN))
    try:
        sc.wait_event("ready", 30)
        wait_for(lambda: stores.tree() == disk_tree(cps), 30, "the seed to be stored")
        old = ["a"] if direction == "file-to-dir" else ["d/x", "d/y"]
        old_keys = {f".checkpoints/{k}" for k in old}
        proxy.set(hold_if=lambda r: r.method == "DELETE" and r.blob in old_keys)  # the crash point
        new_key = swap(cps, direction, tmp_path / "parked")

        def at_the_crash_point() -> bool:
            records = list(proxy.records)
            return (any(r.blob == new_key and r.method == "PUT" and r.status == 201 for r in records)
                    and any(r.method == "DELETE" and r.blob in old_keys for r in records))

        wait_for(at_the_crash_point, 30, "the new shape's upload, then the old one's delete (held)",
                 diagnostics=lambda: f"\n{sc.log()[-3000:]}")
        sc.kill()  # SIGKILL: the new shape is stored, the old one's delete never reached the store
        held = sorted(stores.tree() or ())
        assert set(old) <= set(held) and new_key.split("/", 1)[1] in held, held  # both shapes stored
        assert restore_fresh(stores, tmp_path) == disk_tree(cps)  # the new shape only
        sync_fresh(stores, tmp_path)
    finally:
        proxy.hold_if = None
        sc.kill()
        proxy.stop()
        stores.drop()


@pytest.mark.parametrize("direction", ["file-to-dir", "dir-to-file"])
def test_directory_store_a_crash_right_after_the_new_shapes_upload(direction, tmp_path, request):
    """The directory store holds one shape of a name: the new shape's put replaces the old."""
    stores = Stores("directory", tmp_path, request)
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    seed(cps)
    sc = Sidecar(work, "sync", "--store", stores.url, env=stores.env)
    try:
        sc.wait_event("ready", 30)
        wait_for(lambda: stores.tree() == disk_tree(cps), 30, "the seed to be stored")
        new_key = swap(cps, direction, tmp_path / "parked")
        wait_for(lambda: new_key.split("/", 1)[1] in (stores.tree() or ()), 30, "the new shape's upload", interval=0.002)
        sc.kill()
        assert restore_fresh(stores, tmp_path) == disk_tree(cps)
    finally:
        sc.kill()
        shutil.rmtree(tmp_path / "parked", ignore_errors=True)
