"""``restore`` against real files and the directory store, plus hostile names through the restore."""

from __future__ import annotations

import hashlib
import os
import stat
import time

import anyio
import pytest

from sidecar.paths import Root
from sidecar.restore.latest import restore
from sidecar.store.base import NotFound, ObjectInfo, ObjectMeta, Stream, TransientStoreError
from support import checkpoints_root_with_a_link_out, disk_tree, run_cli, write_atomic


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


def test_root_with_files_is_the_truth_once_this_namespace_holds_it_unless_forced(work):
    work, store = work
    seed(work, store, FILES)
    write_atomic(work / ".checkpoints" / "local.json", b"newer local state")
    r = run_cli("restore", "--store", str(store), cwd=work)  # a new disk: merged, not trusted
    assert r.returncode == 0, r.stderr
    stored = {k.removeprefix(".checkpoints/"): v for k, v in FILES.items() if k.startswith(".checkpoints/")}
    assert disk_tree(work / ".checkpoints") == {**stored, "local.json": b"newer local state"}
    assert (work / ".function_approvals/alice/approval_requests.json").read_bytes() == b"[]"  # that root was empty
    (work / ".checkpoints/resp_2/b.json").unlink()  # the host prunes: the disk is this namespace's now
    r = run_cli("restore", "--store", str(store), cwd=work)
    assert r.returncode == 0, r.stderr
    assert not (work / ".checkpoints/resp_2/b.json").exists()
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
    flat_namespace = False  # the store protocol's traits
    clock_is_local = False

    def __init__(self, objects: dict[str, bytes]):
        self.objects = objects

    async def open(self):
        pass

    def _info(self, key):
        data = self.objects[key]
        return ObjectInfo(key, len(data), hashlib.sha256(data).hexdigest(), 1, 0o600)

    async def list(self, prefix=""):
        for k in list(self.objects):
            if k.startswith(prefix):
                yield self._info(k)

    async def get(self, key):
        if key not in self.objects:
            raise NotFound(key)
        return self.objects[key], self._info(key)

    async def get_stream(self, key):
        data, info = await self.get(key)

        async def chunks():
            for i in range(0, len(data), 4096):
                yield data[i : i + 4096]

        return Stream(info, chunks())

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

    _, result = anyio.run(lambda: restore(store, [root]))
    assert evil in result.refused
    assert disk_tree(tmp_path) == {"w/.checkpoints/good.json": b"good"}


def test_symlink_inside_root_is_never_written_through(tmp_path):
    root, outside = checkpoints_root_with_a_link_out(tmp_path)
    store = MemoryStore({".checkpoints/ctx/x.json": b"x", ".checkpoints/y.json": b"y"})
    _, result = anyio.run(lambda: restore(store, [root], mode="force"))
    assert result.refused == [".checkpoints/ctx/x.json"]
    assert list(outside.iterdir()) == []
    assert (tmp_path / "w/.checkpoints/y.json").read_bytes() == b"y"


def test_a_root_linked_to_a_volume_never_mounted_is_named_as_such(work):
    """A root that is a symbolic link to a missing directory (a volume that was not mounted): one
    line naming the link's target, not ``File exists``, and nothing written beside it."""
    work, store = work
    seed(work, store, FILES)
    (work / ".checkpoints").symlink_to(work / "volume-not-mounted")
    r = run_cli("restore", "--store", str(store), cwd=work)
    assert r.returncode == 1
    [line] = [x for x in r.stderr.splitlines() if "restore failed" in x]
    assert f"is a symbolic link to {work / 'volume-not-mounted'}, which does not exist" in line, line
    assert not (work / "volume-not-mounted").exists()


def test_world_writable_modes_are_not_restored(work):
    work, store = work
    seed(work, store, {".checkpoints/r/x.json": b"x"}, mode=0o666)
    assert run_cli("restore", "--store", str(store), cwd=work).returncode == 0
    assert stat.S_IMODE((work / ".checkpoints/r/x.json").stat().st_mode) == 0o664


def test_a_large_restore_flushes_as_it_fills_and_ends_even_when_objects_vanish(tmp_path, monkeypatch):
    """Past FLUSH_EVERY_BYTES the restored filesystem is flushed in the background as files land
    (and once more at the end); the downloads ending, not a file count, ends that flushing, so an
    object deleted between the listing and its download cannot leave the restore waiting."""
    import sidecar.restore.finish as finish_mod
    import sidecar.restore.progress as progress_mod

    monkeypatch.setattr(progress_mod, "FLUSH_EVERY_BYTES", 64 * 1024)
    flushes: list[str] = []
    real_syncfs = finish_mod.syncfs
    for mod in (progress_mod, finish_mod):
        monkeypatch.setattr(mod, "syncfs", lambda path: (flushes.append(path), real_syncfs(path)))
    files = {f".checkpoints/c{i % 4}/{i}.json": os.urandom(32 * 1024) for i in range(40)}

    class SlowStore(MemoryStore):
        async def list(self, prefix=""):
            if prefix:  # the restore points' listing (.sidecar/points/): none here
                return
            async for info in super().list(prefix):
                yield info
            del self.objects[".checkpoints/c1/5.json"]  # deleted once listed, before its download

        async def get(self, key):
            await anyio.sleep(0.01)
            return await super().get(key)

    store = SlowStore(dict(files))
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))

    async def go():
        with anyio.fail_after(30):
            return await restore(store, [root], concurrency=2)

    listing, result = anyio.run(go)
    assert ".checkpoints/c1/5.json" in listing.objects
    assert result.files == 39
    assert len(flushes) >= 3  # background flushes while filling, and the final one
    expected = {f"w/{k}": v for k, v in files.items() if k != ".checkpoints/c1/5.json"}
    assert disk_tree(tmp_path) == expected


def test_downloads_begin_while_the_listing_is_still_arriving(tmp_path):
    """The restore streams the listing: the first files are fetched before its last page comes.
    (The listing below does not go on until a download has begun; a restore that waited for the
    whole listing would hang there.)"""
    files = {f".checkpoints/c/{i}.json": f"{i}".encode() for i in range(20)}
    fetching = anyio.Event()

    class PagedStore(MemoryStore):
        async def list(self, prefix=""):
            if prefix:  # the restore points' listing (.sidecar/points/): none here
                return
            for i, key in enumerate(sorted(self.objects)):
                if i == 5:  # the second page: only once a file of the first is on its way
                    await fetching.wait()
                yield self._info(key)

        async def get(self, key):
            if key in files:  # a file, not the root's bundle
                fetching.set()
            return await super().get(key)

    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))

    async def go():
        with anyio.fail_after(10):
            return await restore(PagedStore(dict(files)), [root])

    listing, result = anyio.run(go)
    assert result.files == 20 and sorted(listing.objects) == sorted(files)
    assert disk_tree(tmp_path) == {f"w/{k}": v for k, v in files.items()}
    assert not (tmp_path / "w/.checkpoints/.sidecar-restoring").exists()


def test_a_listing_that_fails_midway_is_retried_and_nothing_is_fetched_twice(tmp_path):
    files = {f".checkpoints/c/{i}.json": os.urandom(100) for i in range(10)}
    fetched: list[str] = []

    class FlakyStore(MemoryStore):
        lists = 0

        async def list(self, prefix=""):
            if prefix:  # the restore points' listing (.sidecar/points/): none here
                return
            self.lists += 1
            for i, key in enumerate(sorted(self.objects)):
                if i == 4 and self.lists == 1:
                    raise TransientStoreError("the listing broke off; will retry")
                yield self._info(key)

        async def get(self, key):
            fetched.append(key)
            return await super().get(key)

    store = FlakyStore(dict(files))
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    listing, result = anyio.run(lambda: restore(store, [root], deadline=time.monotonic() + 30))
    assert store.lists == 2 and sorted(listing.objects) == sorted(files)
    assert sorted(k for k in fetched if k in files) == sorted(files)  # each file once
    assert disk_tree(tmp_path) == {f"w/{k}": v for k, v in files.items()}


def test_a_cut_short_snapshot_commit_is_laid_over_the_files_it_names(tmp_path):
    """A bundle (a snapshot commit cut short after its bundle was stored) holds the newer state:
    its files replace their own objects, its deletions are not restored, its new files are."""
    from sidecar.snapshot import Change, bundle_key, encode_bundle

    def change(key, data):
        return Change(key, data, None if data is None else ObjectMeta.of(data, 2, 0o600))

    bundle = encode_bundle(".checkpoints", [change(".checkpoints/a.json", b"new a"),
                                            change(".checkpoints/b.json", None),
                                            change(".checkpoints/c.json", b"new c"),
                                            change(".function_approvals/x.json", b"forged")])
    store = MemoryStore({".checkpoints/a.json": b"old a", ".checkpoints/b.json": b"old b",
                         ".checkpoints/d.json": b"d", ".function_approvals/x.json": b"real x",
                         bundle_key(".checkpoints"): bundle})
    roots = [Root(".checkpoints", str(tmp_path / "w" / ".checkpoints")),
             Root(".function_approvals", str(tmp_path / "w" / ".function_approvals"))]
    listing, result = anyio.run(lambda: restore(store, roots))
    # the forged change to another root's file is refused, and hides nothing: the real one is restored
    assert disk_tree(tmp_path) == {"w/.checkpoints/a.json": b"new a", "w/.checkpoints/c.json": b"new c",
                                   "w/.checkpoints/d.json": b"d", "w/.function_approvals/x.json": b"real x"}
    assert result.refused == [".function_approvals/x.json"]
    assert [(d.name, d.restore) for d in result.decisions] == [(".checkpoints", True), (".function_approvals", True)]
    assert listing.bundles == {".checkpoints"}
    assert not list(tmp_path.rglob(".sidecar-restoring"))


def _bundle_store(tmp_path, fail_after: int | None, replaced: bytes | None = None):
    """A store holding a bundle of two files (one streamed in several chunks) whose first stream
    breaks off (a transient error) after ``fail_after`` bytes; ``replaced``: the bundle another
    sidecar wrote meanwhile, served from then on."""
    from sidecar.snapshot import Change, bundle_key, encode_bundle

    big = bytes(range(256)) * 4096  # 1 MiB: streamed into place
    changes = [Change(".checkpoints/big.bin", big, ObjectMeta.of(big, 2, 0o600)),
               Change(".checkpoints/small.json", b"new", ObjectMeta.of(b"new", 2, 0o600))]
    key = bundle_key(".checkpoints")

    class BreaksOnce(MemoryStore):
        streams = 0

        async def get_stream(self, k):
            info, chunks = await super().get_stream(k)
            if k != key:
                return Stream(info, chunks)
            self.streams += 1
            if self.streams > 1:
                if replaced is not None:
                    self.objects[key] = replaced
                return await super().get_stream(k)

            async def breaking():
                sent = 0
                async for chunk in chunks:
                    if fail_after is not None and sent >= fail_after:
                        raise TransientStoreError("connection reset; will retry")
                    sent += len(chunk)
                    yield chunk

            return Stream(info, breaking())

    store = BreaksOnce({".checkpoints/big.bin": b"old", ".checkpoints/small.json": b"old",
                        key: encode_bundle(".checkpoints", changes)})
    return store, big


def test_a_bundle_read_cut_short_is_read_again(tmp_path):
    store, big = _bundle_store(tmp_path, fail_after=600 * 1024)
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    _, result = anyio.run(lambda: restore(store, [root], deadline=time.monotonic() + 30))
    assert store.streams == 2
    assert disk_tree(tmp_path) == {"w/.checkpoints/big.bin": big, "w/.checkpoints/small.json": b"new"}
    assert not list(tmp_path.rglob(".sidecar-restore*"))  # no temp file left behind


def test_a_bundle_replaced_while_it_is_read_fails_the_restore(tmp_path):
    from sidecar.restore.latest import RestoreError
    from sidecar.snapshot import Change, encode_bundle

    other = encode_bundle(".checkpoints", [Change(".checkpoints/small.json", b"newer", ObjectMeta.of(b"newer", 3, 0o600))])
    store, _ = _bundle_store(tmp_path, fail_after=600 * 1024, replaced=other)
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    with pytest.raises(RestoreError, match="bundle of .* changed while it was being restored"):
        anyio.run(lambda: restore(store, [root], deadline=time.monotonic() + 30))
    assert (tmp_path / "w/.checkpoints/.sidecar-restoring").exists()


def test_a_root_with_nothing_stored_is_not_even_created(tmp_path):
    store = MemoryStore({".checkpoints/a.json": b"a"})
    roots = [Root(".checkpoints", str(tmp_path / "w" / ".checkpoints")),
             Root(".function_approvals", str(tmp_path / "w" / ".function_approvals"))]
    _, result = anyio.run(lambda: restore(store, roots))
    assert [(d.name, d.restore, d.reason) for d in result.decisions][1] == (".function_approvals", False, "nothing stored")
    assert not (tmp_path / "w/.function_approvals").exists()


def test_a_listing_lost_after_files_landed_fails_the_restore_and_keeps_the_marker(tmp_path):
    """Once files are in place, a store that stops answering leaves a fragment: that is a failed
    restore (the host must not start on it, even with SIDECAR_RESTORE_OPTIONAL), not an
    unreachable store, and the root's marker stays so that the next start restores it again."""
    from sidecar.restore.latest import RestoreError

    files = {f".checkpoints/c/{i}.json": b"x" for i in range(10)}
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))

    class DyingStore(MemoryStore):
        async def list(self, prefix=""):
            if prefix:  # the restore points' listing (.sidecar/points/): none here
                return
            for i, key in enumerate(sorted(self.objects)):
                if i == 3:
                    while not list(tmp_path.rglob("*.json")):  # until a file has landed
                        await anyio.sleep(0.005)
                    raise TransientStoreError("connection refused; will retry")
                yield self._info(key)

    async def go():
        with anyio.fail_after(10):
            await restore(DyingStore(dict(files)), [root])

    with pytest.raises(RestoreError, match="cut short after .* connection refused"):
        anyio.run(go)
    assert (tmp_path / "w/.checkpoints/.sidecar-restoring").exists()


def test_a_snapshot_commit_that_begins_during_the_restore_fails_it(tmp_path):
    """The bundle is read first; if the listing then shows one, another sidecar began a commit
    meanwhile and the files restored may mix two states: the restore fails (and is redone)."""
    from sidecar.restore.latest import RestoreError
    from sidecar.snapshot import bundle_key

    class CommitDuringRestore(MemoryStore):
        async def list(self, prefix=""):
            if prefix:  # the restore points' listing (.sidecar/points/): none here
                return
            async for info in super().list(prefix):
                yield info
            self.objects[bundle_key(".checkpoints")] = b"written by another sidecar"
            yield self._info(bundle_key(".checkpoints"))

    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    with pytest.raises(RestoreError, match="snapshot commit .* began"):
        anyio.run(lambda: restore(CommitDuringRestore({".checkpoints/a.json": b"a"}), [root]))
    assert (tmp_path / "w/.checkpoints/.sidecar-restoring").exists()


def test_an_unreadable_bundle_is_a_one_line_restore_error(tmp_path):
    from sidecar.restore.latest import RestoreError
    from sidecar.snapshot import bundle_key

    store = MemoryStore({".checkpoints/a.json": b"a", bundle_key(".checkpoints"): b"\x00 not a bundle"})
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    with pytest.raises(RestoreError, match="bundle of .* is unreadable"):
        anyio.run(lambda: restore(store, [root]))


def test_downloads_do_not_wait_for_the_bundle_but_writes_do(tmp_path):
    """Reading a root's bundle (usually a "not found") is a round trip the downloads do not wait
    for; no file is written before its answer, which here comes only once a download has begun."""
    from sidecar.snapshot import bundle_key

    files = {f".checkpoints/{i}.json": b"x" for i in range(5)}
    downloading = anyio.Event()
    written_before_answer: list[str] = []
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))

    class SlowBundleStore(MemoryStore):
        async def get_stream(self, key):
            if key == bundle_key(".checkpoints"):
                await downloading.wait()
                written_before_answer.extend(os.listdir(root.path))
                raise NotFound(key)
            return await super().get_stream(key)

        async def get(self, key):
            downloading.set()
            return await super().get(key)

    async def go():
        with anyio.fail_after(10):
            return await restore(SlowBundleStore(dict(files)), [root])

    _, result = anyio.run(go)
    assert result.files == 5
    assert [n for n in written_before_answer if n.endswith(".json")] == []


def test_a_restore_cancelled_while_the_listing_streams_in_ends_as_cancelled(tmp_path):
    """A stop during the listing cancels the download workers first; the listing task may still
    hand over what it has in hand before it sees the cancellation. That must end the restore as
    cancelled (exit 1 for sync, nothing to flush), not as an internal error."""
    from sidecar.store.directory import DirectoryStore

    class StoppedMidListing(DirectoryStore):
        scope: anyio.CancelScope

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.worker_stopped = anyio.Event()

        async def get(self, key):
            if key.startswith(".sidecar/"):  # the bundle read: there is none
                return await super().get(key)
            try:
                await anyio.sleep_forever()
            finally:
                self.worker_stopped.set()

        async def list(self, prefix=""):
            if prefix:  # the restore points' listing (.sidecar/points/): none here
                return
            items = [i async for i in super().list(prefix)]
            yield items[0]
            self.scope.cancel()  # the stop comes while the rest of the listing is in hand
            with anyio.CancelScope(shield=True):
                await self.worker_stopped.wait()
            for info in items[1:]:
                yield info

    async def main():
        seeded = DirectoryStore(str(tmp_path / "store"))
        await seeded.open()
        for i in range(3):
            data = f"{i}".encode()
            await seeded.put(f".checkpoints/{i}.json", data, ObjectMeta.of(data, 1, 0o600))
        store = StoppedMidListing(str(tmp_path / "store"))
        await store.open()
        root = Root(".checkpoints", str(tmp_path / "work" / ".checkpoints"))
        with anyio.CancelScope() as scope:
            store.scope = scope
            await restore(store, [root], concurrency=1)
        assert scope.cancelled_caught

    anyio.run(main)


def test_a_full_disk_says_how_many_files_landed_and_no_total(tmp_path, monkeypatch):
    """Issue #34, item 6: the full-disk message gave "N of M files", M being only the files listed
    and queued so far (restore points' files are counted as they land). It says what landed."""
    import errno

    import sidecar.restore.place as place_mod
    from sidecar.restore.latest import RestoreError

    real = place_mod.write_restored
    written: list[list[str]] = []

    def fill_up(root, parts, *args, **kwargs):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(parts)
        return real(root, parts, *args, **kwargs)

    monkeypatch.setattr(place_mod, "write_restored", fill_up)
    store = MemoryStore({f".checkpoints/{i}.json": b"x" * 10 for i in range(6)})
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    with pytest.raises(RestoreError) as e:
        anyio.run(lambda: restore(store, [root], concurrency=1))
    assert str(e.value) == (f"no space left on device while restoring into {root.path} (2 files restored before it "
                            "filled up; no partial file left)")
