"""The directory store's put racing a delete of the same directory's last other key: the delete
removes the directories it leaves empty (``_prune``), and a put on its way down must take that as
"nothing in the way", make them again and store its object, never fail (a failed put is counted
as a store failure and retried, a degraded store in between)."""

from __future__ import annotations

import os

import anyio.from_thread
import pytest

import sidecar.store.directory as directory
import sidecar.store.dirfs as dirfs
import sidecar.store.dirlayout as dirlayout
from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore

pytestmark = pytest.mark.anyio

STAMP = 1_700_000_000_000_000_000


def meta(data: bytes, version: int) -> ObjectMeta:
    return ObjectMeta.of(data, STAMP, 0o644, version=version)


@pytest.mark.parametrize("pruned", [["u0", "ctx1"], ["u0"]])
async def test_a_put_whose_directories_are_pruned_on_its_way_stores_its_object(tmp_path, monkeypatch, pruned):
    store = DirectoryStore(str(tmp_path / "store"), "ns")
    await store.open()
    await store.put("u0/ctx1/old.json", b"old", meta(b"old", 1))
    top = tmp_path / "store" / "ns"
    real = dirlayout._lstat_at
    fired = []

    def lstat_then_prune(dfd: int, name: str):
        st = real(dfd, name)
        if name == pruned[-1] and not fired:  # seen as a directory, then removed by a delete's prune
            fired.append(name)
            os.unlink(top / "u0" / "ctx1" / "old.json")
            os.rmdir(top / "u0" / "ctx1")
            if pruned == ["u0"]:
                os.rmdir(top / "u0")
        return st

    monkeypatch.setattr(dirlayout, "_lstat_at", lstat_then_prune)
    await store.put("u0/ctx1/new.json", b"new", meta(b"new", 2))
    assert fired
    assert (top / "u0" / "ctx1" / "new.json").read_bytes() == b"new"
    data, info = await store.get("u0/ctx1/new.json")
    assert (data, info.version) == (b"new", 2)
    await store.aclose()



@pytest.mark.parametrize("stale", ["u0", "u0/ctx1"])
async def test_a_stale_object_a_delete_removes_on_a_puts_way_is_not_in_its_way(tmp_path, monkeypatch, stale):
    """The host replaced the file ``stale`` by a directory: the put below it finds the stale
    object, and a concurrent delete of it (data, then record) lands before the put's check."""
    store = DirectoryStore(str(tmp_path / "store"), "ns")
    await store.open()
    await store.put(stale, b"old", meta(b"old", 1))
    real = dirlayout._lstat_at
    fired = []

    def lstat_then_delete(dfd: int, name: str):
        st = real(dfd, name)
        if name == stale.split("/")[-1] and st is not None and not fired:
            fired.append(name)
            store._remove(stale, stale.split("/"), None)  # the delete's own steps, in this thread
        return st

    monkeypatch.setattr(dirlayout, "_lstat_at", lstat_then_delete)
    await store.put(f"{stale}/x/new.json", b"new", meta(b"new", 2))
    assert fired
    data, info = await store.get(f"{stale}/x/new.json")
    assert (data, info.version) == (b"new", 2)
    assert [i.key async for i in store.list()] == [f"{stale}/x/new.json"]
    await store.aclose()


def _replace_dir_by_file(tmp_path, monkeypatch, module, name, racing, delete, after=False):
    """A put of ``a`` where the directory of objects ``a/x`` and ``a/sub/y`` stands (the host
    replaced the directory by a file); ``racing(real, args)`` says when the deletes of the keys
    ``delete`` below it (the host's removal of the directory's files, other keys, other lock
    stripes) land inside the put's removal of the stale objects. They run in this thread with the
    delete's own steps (:meth:`DirectoryStore._remove`)."""

    async def main():
        store = DirectoryStore(str(tmp_path / "store"), "ns")
        await store.open()
        for key in ("a/x", "a/sub/y"):
            await store.put(key, b"old", meta(b"old", 1))
        real = getattr(module, name)
        fired = []

        def step(*args, **kwargs):
            done = real(*args, **kwargs) if after else None  # (a lstat: the deletes land after it)
            if not fired and racing(*args, **kwargs):
                fired.append(args)
                for key in delete:
                    store._remove(key, key.split("/"), None)
            return done if after else real(*args, **kwargs)

        monkeypatch.setattr(module, name, step)
        await store.put("a", b"new", meta(b"new", 2))
        monkeypatch.undo()
        assert fired
        data, info = await store.get("a")
        assert (data, info.version) == (b"new", 2)
        assert [i.key async for i in store.list()] == ["a"]
        assert not (tmp_path / "store" / "ns" / directory.META_DIR / "a").exists()  # no record left below
        await store.aclose()

    return main()


@pytest.mark.parametrize("delete", [["a/x"], ["a/sub/y"], ["a/x", "a/sub/y"]])
async def test_a_delete_below_a_directory_a_put_removes_meanwhile_is_not_a_failure(tmp_path, monkeypatch, delete):
    """The deletes land while shutil.rmtree removes the stale objects' data files (after its
    scandir): what they removed (a file, a directory they pruned) is gone already."""
    await _replace_dir_by_file(tmp_path, monkeypatch, os, "unlink",
                               lambda name, *, dir_fd=None: dir_fd is not None, delete)


@pytest.mark.parametrize("delete", [["a/x"], ["a/sub/y"]])
async def test_a_delete_below_a_directory_whose_records_a_put_removes_is_not_a_failure(tmp_path, monkeypatch, delete):
    """The same, while shutil.rmtree removes their records (the data files are gone: the delete
    removes the record alone, and prunes the records' directories it empties)."""
    await _replace_dir_by_file(tmp_path, monkeypatch, os, "unlink",
                               lambda name, *, dir_fd=None: dir_fd is not None and name.endswith(".json"), delete)


async def test_a_records_directory_a_delete_prunes_before_a_put_removes_it_is_not_a_failure(tmp_path, monkeypatch):
    """The put has seen the records' directory ``.sidecar-meta/a`` (after removing the data); the
    deletes remove its last records and prune it before the put opens it."""
    seen = []

    def records_dir_seen(dfd: int, name: str) -> bool:
        seen.append(name)
        return name == "a" and seen.count("a") == 2  # the first is the data's, on the put's way

    await _replace_dir_by_file(tmp_path, monkeypatch, dirlayout, "_lstat_at", records_dir_seen, ["a/x", "a/sub/y"],
                               after=True)


async def test_a_directory_a_delete_prunes_while_a_put_lists_the_stale_objects_is_not_a_failure(tmp_path, monkeypatch):
    """The put has listed ``a``'s entries (to check they are all stored objects); the delete of
    ``a/sub/y`` prunes ``a/sub`` before the put opens it."""
    await _replace_dir_by_file(tmp_path, monkeypatch, dirfs, "_child_dir",
                               lambda dfd, name, where: name == "sub", ["a/sub/y"])


async def test_a_stale_object_replaced_by_a_directory_of_other_keys_is_not_in_a_puts_way(tmp_path, monkeypatch):
    """The host replaced the file ``a`` by a directory of files ``a/b`` and ``a/c``: the put of
    ``a/b`` sees the stale object ``a``; before it checks it, the delete of ``a`` and the put of
    ``a/c`` (other keys) have run. A directory of keys stands there now: nothing in the way."""
    store = DirectoryStore(str(tmp_path / "store"), "ns")
    await store.open()
    await store.put("a", b"old", meta(b"old", 1))
    real = dirlayout._lstat_at
    fired = []

    def lstat_then_delete_and_put(dfd: int, name: str):
        st = real(dfd, name)
        if name == "a" and st is not None and not fired:
            fired.append(name)
            store._remove("a", ["a"], None)
            anyio.from_thread.run(store.put, "a/c", b"c", meta(b"c", 3))
        return st

    monkeypatch.setattr(dirlayout, "_lstat_at", lstat_then_delete_and_put)
    await store.put("a/b", b"b", meta(b"b", 2))
    monkeypatch.undo()
    assert fired
    assert [((await store.get(k))[0]) for k in ("a/b", "a/c")] == [b"b", b"c"]
    assert [i.key async for i in store.list()] == ["a/b", "a/c"]
    await store.aclose()
