"""``restore`` against real files and the directory store, plus hostile names through the restorer."""

from __future__ import annotations

import hashlib
import os
import stat

import anyio
import pytest

from support import disk_tree, run_cli, write_atomic
from sidecar.paths import Root
from sidecar.restorer import Listing, list_store, restore
from sidecar.store.base import NotFound, ObjectInfo, ObjectMeta


def seed(work, store, files: dict[str, bytes], mode=0o640):
    """Fill the store the real way: sync once, then remove the local tree (compute recreation)."""
    src = work.parent / "seed"
    for rel, data in files.items():
        write_atomic(src / rel, data)
        os.chmod(src / rel, mode)
        os.utime(src / rel, ns=(1_700_000_000_123_456_789, 1_700_000_000_123_456_789))
    roots = ",".join(sorted({str(src / rel.split("/", 1)[0]) for rel in files}))
    r = run_cli("run", "--store", str(store), "--roots", roots, "--", "true", cwd=work)
    assert r.returncode == 0, r.stderr
    return src


FILES = {
    ".checkpoints/alice/resp_1/a.json": b'{"workflow_name": "approval-workflow"}',
    ".checkpoints/resp_2/b.json": os.urandom(70_000),
    ".function_approvals/alice/approval_requests.json": b"[]",
}


def test_restore_fills_empty_roots_exactly(work):
    work, store = work
    seed(work, store, FILES)
    (work / ".checkpoints" / "resp_1").mkdir(parents=True)  # the empty placeholder a failed continuation leaves
    r = run_cli("restore", "--store", str(store), cwd=work)
    assert r.returncode == 0, r.stderr
    for rel, data in FILES.items():
        p = work / rel
        assert p.read_bytes() == data
        st = p.stat()
        assert st.st_mtime_ns == 1_700_000_000_123_456_789
        assert stat.S_IMODE(st.st_mode) == 0o640
    assert not [n for n in os.listdir(work / ".checkpoints" / "resp_2") if n.startswith(".sidecar")]


def test_root_with_files_is_the_truth_unless_forced(work):
    work, store = work
    seed(work, store, FILES)
    write_atomic(work / ".checkpoints" / "local.json", b"newer local state")
    r = run_cli("restore", "--store", str(store), cwd=work)
    assert r.returncode == 0, r.stderr
    assert disk_tree(work / ".checkpoints") == {"local.json": b"newer local state"}
    assert (work / ".function_approvals/alice/approval_requests.json").read_bytes() == b"[]"  # that root was empty
    r = run_cli("restore", "--force-restore", "--store", str(store), cwd=work)
    assert r.returncode == 0
    assert (work / ".checkpoints/resp_2/b.json").read_bytes() == FILES[".checkpoints/resp_2/b.json"]


def test_empty_store_is_fine_and_unreachable_store_is_not(work):
    work, store = work
    r = run_cli("restore", "--store", str(store), cwd=work)
    assert r.returncode == 0, r.stderr
    blocker = work.parent / "not-a-dir"
    blocker.write_text("x")
    r = run_cli("restore", "--store", str(blocker / "store"), cwd=work)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the store" in lines[0] and "Traceback" not in r.stderr
    r = run_cli("restore", "--restore-optional", "--store", str(blocker / "store"), cwd=work)
    assert r.returncode == 0


def test_generated_workflow_names_warn(work):
    work, store = work
    seed(work, store, {".checkpoints/r/x.json": b'{"workflow_name": "WorkflowBuilder-0b7e6d0c-1c4e-4f7a-9a52-5d1f0f3f8a11"}'})
    r = run_cli("restore", "--store", str(store), cwd=work)
    assert r.returncode == 0
    assert "unresumable_checkpoints" in r.stderr and "WorkflowBuilder(name=" in r.stderr


class MemoryStore:
    """An in-memory store for names a real backend on this disk cannot even hold (``..``, ``/``,
    backslashes); it implements the same interface. The Azure store's tests repeat these against
    Azurite, where such blob names are legal."""

    description = "memory://test"

    def __init__(self, objects: dict[str, bytes]):
        self.objects = objects

    async def open(self):
        pass

    def _info(self, key):
        data = self.objects[key]
        return ObjectInfo(key, len(data), hashlib.sha256(data).hexdigest(), 1, 0o600)

    async def list(self, prefix=""):
        for k in self.objects:
            yield self._info(k)

    async def get(self, key):
        if key not in self.objects:
            raise NotFound(key)
        return self.objects[key], self._info(key)

    async def put(self, key, data, meta: ObjectMeta):
        raise NotImplementedError

    async def delete(self, key):
        self.objects.pop(key, None)

    async def aclose(self):
        pass


@pytest.mark.parametrize("evil", [
    ".checkpoints/../../escaped.json", "/abs.json", ".checkpoints/..\\..\\escaped.json",
    ".checkpoints/a/../../escaped.json", "../escaped.json", ".checkpoints/ok\x00.json",
])
def test_hostile_stored_names_are_refused(tmp_path, evil):
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    store = MemoryStore({evil: b"evil", ".checkpoints/good.json": b"good"})

    async def go():
        listing = await list_store(store, [root])
        return await restore(store, [root], listing)

    result = anyio.run(go)
    assert evil in result.refused
    assert disk_tree(tmp_path) == {"w/.checkpoints/good.json": b"good"}


def test_symlink_inside_root_is_never_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    os.makedirs(root.path)
    os.symlink(outside, os.path.join(root.path, "ctx"))
    store = MemoryStore({".checkpoints/ctx/x.json": b"x", ".checkpoints/y.json": b"y"})
    result = anyio.run(lambda: restore(store, [root], Listing(
        {k: store._info(k) for k in store.objects}), mode="force"))
    assert result.refused == [".checkpoints/ctx/x.json"]
    assert list(outside.iterdir()) == []
    assert (tmp_path / "w/.checkpoints/y.json").read_bytes() == b"y"


def test_world_writable_modes_are_not_restored(work):
    work, store = work
    seed(work, store, {".checkpoints/r/x.json": b"x"}, mode=0o666)
    assert run_cli("restore", "--store", str(store), cwd=work).returncode == 0
    assert stat.S_IMODE((work / ".checkpoints/r/x.json").stat().st_mode) == 0o664


def test_a_large_restore_flushes_as_it_fills_and_ends_even_when_objects_vanish(tmp_path, monkeypatch):
    """Past FLUSH_EVERY_BYTES the restored filesystem is flushed in the background as files land
    (and once more at the end); the downloads ending, not a file count, ends that flushing, so an
    object deleted between the listing and its download cannot leave the restore waiting."""
    import sidecar.restorer as restorer_mod

    monkeypatch.setattr(restorer_mod, "FLUSH_EVERY_BYTES", 64 * 1024)
    flushes: list[str] = []
    real_syncfs = restorer_mod.syncfs
    monkeypatch.setattr(restorer_mod, "syncfs", lambda path: (flushes.append(path), real_syncfs(path)))
    files = {f".checkpoints/c{i % 4}/{i}.json": os.urandom(32 * 1024) for i in range(40)}

    class SlowStore(MemoryStore):
        async def get(self, key):
            await anyio.sleep(0.01)
            return await super().get(key)

    store = SlowStore(dict(files))
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))

    async def go():
        listing = await list_store(store, [root])
        del store.objects[".checkpoints/c1/5.json"]  # deleted after the listing
        with anyio.fail_after(30):
            return await restore(store, [root], listing, concurrency=2)

    result = anyio.run(go)
    assert result.files == 39
    assert len(flushes) >= 3  # background flushes while filling, and the final one
    expected = {f"w/{k}": v for k, v in files.items() if k != ".checkpoints/c1/5.json"}
    assert disk_tree(tmp_path) == expected
