"""The directory store under concurrent operations on neighbouring keys.

A delete prunes the directories it leaves empty; a put of a neighbour in the same directory must
never fail because of that (the uploader runs operations on different keys at once). Deterministic:
the delete is run from inside the put, at the step where the race bites.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest

import sidecar.store.directory as directory_mod
import sidecar.store.dirfs as dirfs_mod
from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore

pytestmark = pytest.mark.faults

STAMP = 1_700_000_000_000_000_000


def _neighbour(store: DirectoryStore, key: str, names: str = "bcdefghijk") -> str:
    """A key in ``key``'s directory whose lock is not ``key``'s (the race below runs its delete
    from inside ``key``'s locked section)."""
    head = key.rpartition("/")[0]
    for n in names:
        other = f"{head}/{n}.json"
        if dirfs_mod._lock_name(other) != dirfs_mod._lock_name(key):
            return other
    raise AssertionError("no neighbour with a lock of its own")


def test_a_replace_survives_a_neighbours_delete_pruning_the_record_directory(tmp_path, monkeypatch):
    old, new, other = b"version 1", b"version 2!", b"neighbour"

    async def main():
        store = DirectoryStore(str(tmp_path / "store"))
        await store.open()
        neighbour = _neighbour(store, "r/a.json")
        await store.put("r/a.json", old, ObjectMeta.of(old, STAMP, 0o600))
        await store.put(neighbour, other, ObjectMeta.of(other, STAMP, 0o600))
        _data, meta_path = store._paths("r/a.json")
        real = directory_mod._remove_durably
        raced = []

        def delete_after(path, top):
            real(path, top)
            # The put has just removed a.json's old record: the neighbour's delete now empties
            # (and prunes) the records' directory before the put writes the new record there.
            if not raced and path == meta_path:
                raced.append(path)
                anyio.from_thread.run(store.delete, neighbour)
                assert not (tmp_path / "store" / directory_mod.META_DIR / "r").exists()

        monkeypatch.setattr(directory_mod, "_remove_durably", delete_after)
        await store.put("r/a.json", new, ObjectMeta.of(new, STAMP + 1, 0o600))
        assert raced, "the race was not set up: the put no longer removes the old record first"
        data, info = await store.get("r/a.json")
        assert data == new and info.sha256 == ObjectMeta.of(new, 0, 0).sha256
        assert [i.key async for i in store.list("r/")] == ["r/a.json"]
        await store.aclose()

    anyio.run(main)


def test_a_put_survives_a_neighbours_delete_pruning_its_directory_before_the_temp_file(tmp_path, monkeypatch):
    """The put has opened the key's directory; before its temp file is in it, the last other key
    there is deleted and the directory pruned: the put makes it again."""
    data, other = b"a new key", b"neighbour"

    async def main():
        store = DirectoryStore(str(tmp_path / "store"))
        await store.open()
        neighbour = _neighbour(store, "r/d/a.json")
        await store.put(neighbour, other, ObjectMeta.of(other, STAMP, 0o600))
        real = dirfs_mod._new_temp
        raced = []

        def delete_first(dfd):
            if not raced:
                raced.append(dfd)
                anyio.from_thread.run(store.delete, neighbour)
                assert not (tmp_path / "store" / "r").exists()
            return real(dfd)

        monkeypatch.setattr(dirfs_mod, "_new_temp", delete_first)
        await store.put("r/d/a.json", data, ObjectMeta.of(data, STAMP, 0o600))
        assert raced
        got, info = await store.get("r/d/a.json")
        assert got == data and info.sha256 == ObjectMeta.of(data, 0, 0).sha256
        assert [i.key async for i in store.list()] == ["r/d/a.json"]
        await store.aclose()

    anyio.run(main)


class _Held:
    """A streamed source that, once its temp file is open, waits for ``release`` before its bytes."""

    def __init__(self, data: bytes, writing: threading.Event, release: threading.Event) -> None:
        self.data, self.size, self.md5 = data, len(data), hashlib.md5(data).digest()
        self.writing, self.release = writing, release

    def iter_sync(self):
        self.writing.set()
        self.release.wait(10)
        yield self.data

    async def chunks(self):  # pragma: no cover - the directory store reads iter_sync
        yield self.data


def test_the_first_puts_crash_leftover_cleanup_spares_a_concurrent_puts_temp(tmp_path, monkeypatch):
    """A writer's first puts run at once; the one removing a crashed writer's temp files must
    not remove the temp file another of them is writing."""
    top = tmp_path / "store"
    top.mkdir()
    leftover = top / (directory_mod.TMP_PREFIX + "leftover")
    leftover.write_bytes(b"crashed")
    crashed_at = time.time_ns() - 3600 * 10**9  # its writer died an hour ago (no lock on it)
    os.utime(leftover, ns=(crashed_at, crashed_at))
    writing, release = threading.Event(), threading.Event()
    real = DirectoryStore._clean_temps
    calls = []

    def clean_while_b_writes(self):
        calls.append(1)
        if len(calls) == 1:  # A's clean: let B get as far as writing its temp first
            writing.wait(2)
        real(self)
        release.set()

    monkeypatch.setattr(DirectoryStore, "_clean_temps", clean_while_b_writes)
    b_data = b"b" * 100

    async def main():
        store = DirectoryStore(str(top))
        await store.open()
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.put, "r/a.json", b"a", ObjectMeta.of(b"a", STAMP, 0o600))
            with anyio.fail_after(5):
                while not calls:  # A is cleaning
                    await anyio.sleep(0.001)
            tg.start_soon(store.put, "r/b.json", _Held(b_data, writing, release), ObjectMeta.of(b_data, STAMP, 0o600))
        assert (await store.get("r/b.json"))[0] == b_data
        assert not list(top.glob(directory_mod.TMP_PREFIX + "*"))
        await store.aclose()

    anyio.run(main)


def test_a_record_without_a_checksum_leaves_the_object_unverified_not_corrupt(tmp_path):
    async def main():
        store = DirectoryStore(str(tmp_path / "store"))
        await store.open()
        await store.put("r/a.json", b"abc", ObjectMeta.of(b"abc", STAMP, 0o600))
        _data, meta_path = store._paths("r/a.json")
        with open(meta_path) as f:
            rec = json.load(f)
        rec["sha256"] = None
        with open(meta_path, "w") as f:
            json.dump(rec, f)
        data, info = await store.get("r/a.json")
        assert data == b"abc" and info.sha256 is None
        await store.aclose()

    anyio.run(main)


@pytest.mark.parametrize("same_store", [True, False], ids=["one sidecar", "two sidecars"])
def test_an_older_streamed_put_that_finishes_last_never_replaces_a_newer_one(tmp_path, same_store):
    """The older version's put streams its bytes first and is held there; the newer version's put
    runs start to finish meanwhile (the lock never covers the bytes' streaming, or it would wait
    here for ever); then the older one finishes. Its version check and rename are one critical
    section with the newer put's, so the store keeps the newer version."""
    older, newer = b"older version " * 1000, b"newer version"
    writing, release = threading.Event(), threading.Event()

    async def main():
        store = DirectoryStore(str(tmp_path / "store"))
        await store.open()
        other = store if same_store else DirectoryStore(str(tmp_path / "store"))
        await other.open()
        await store.put("r/a.json", b"first", ObjectMeta.of(b"first", STAMP, 0o600, version=1))
        results = {}

        async def put_older():
            results["older"] = await store.put("r/a.json", _Held(older, writing, release),
                                               ObjectMeta.of(older, STAMP + 2, 0o600, version=2))

        async with anyio.create_task_group() as tg:
            tg.start_soon(put_older)
            with anyio.fail_after(10):
                while not writing.is_set():  # the older put is streaming its bytes
                    await anyio.sleep(0.001)
                results["newer"] = await other.put("r/a.json", newer, ObjectMeta.of(newer, STAMP + 1, 0o600, version=3))
            release.set()
        assert results["newer"].version == 3
        assert results["older"].version == 3, "the older put reports itself stored"
        data, info = await store.get("r/a.json")
        assert data == newer and info.version == 3 and info.sha256 == ObjectMeta.of(newer, 0, 0).sha256
        assert [(i.key, i.version) async for i in store.list()] == [("r/a.json", 3)]
        assert not list((tmp_path / "store").rglob(directory_mod.TMP_PREFIX + "*")), "the older put's temp file"
        await store.aclose()
        await other.aclose()

    anyio.run(main)
