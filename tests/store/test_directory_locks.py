"""The directory store's lock files go with its namespace: a delete of what is not there makes
none, the namespace's last delete removes them (and its directories), never one a writer holds,
and a writer that waited on a lock file removed meanwhile takes a new one (a removed lock file
locks nothing)."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

import sidecar.store.dirfs as dirfs
import sidecar.store.dirlayout as dirlayout
from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore

pytestmark = pytest.mark.anyio


def meta_dir(base: Path) -> Path:
    return base / "ns" / ".sidecar-meta"


async def opened(base: Path) -> DirectoryStore:
    store = DirectoryStore(str(base), "ns")
    await store.open()
    return store


async def test_a_delete_of_what_is_not_there_makes_no_lock_file(tmp_path):
    store = await opened(tmp_path)
    await store.delete("ctx/missing.json")
    assert not await store.delete_if(".sidecar/owner", 5)
    assert not meta_dir(tmp_path).exists()
    await store.aclose()


async def test_the_last_delete_removes_the_lock_files_but_never_a_held_one(tmp_path):
    store, other = await opened(tmp_path), await opened(tmp_path)
    for key in ("a", "b/c"):
        await store.put(key, b"x", ObjectMeta.of(b"x", 1, 0o600, version=1))
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with other._locked(".sidecar/owner"):  # (a writer of its own objects, in its critical section)
            held.set()
            assert release.wait(10)

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, hold)
        assert await anyio.to_thread.run_sync(held.wait, 10)
        await store.delete("a")
        await store.delete("b/c")
        kept = sorted(os.listdir(meta_dir(tmp_path)))
        release.set()
    assert dirfs._lock_name(".sidecar/owner") in kept, "a held lock file was removed"
    await store.put("d", b"x", ObjectMeta.of(b"x", 1, 0o600, version=1))
    await store.delete("d")  # now nobody holds one: they go, with the namespace's directory
    assert not (tmp_path / "ns").exists()
    await store.put("e", b"x", ObjectMeta.of(b"x", 1, 0o600, version=1))  # and come back with a put
    assert [i.key async for i in store.list()] == ["e"]
    for s in (store, other):
        await s.aclose()


async def test_a_delete_waiting_on_a_lock_file_removed_meanwhile_takes_a_new_one(tmp_path, monkeypatch):
    store, other = await opened(tmp_path), await opened(tmp_path)
    await store.put("k", b"x", ObjectMeta.of(b"x", 1, 0o600, version=1))
    waiting, go = threading.Event(), threading.Event()
    calls: list[int] = []

    class Paused:  # the first blocking flock of `store` waits until the namespace is emptied
        def __getattr__(self, name: str):
            return getattr(fcntl, name)

        def flock(self, fd: int, op: int) -> None:
            calls.append(fd)
            if len(calls) == 1:
                waiting.set()
                assert go.wait(10)
            fcntl.flock(fd, op)

    got: dict = {}

    async def delete_paused() -> None:
        got["removed"] = await store.delete_if("k", 1)

    async with anyio.create_task_group() as tg:
        monkeypatch.setattr(dirlayout, "fcntl", Paused())
        tg.start_soon(delete_paused)
        assert await anyio.to_thread.run_sync(waiting.wait, 10)
        monkeypatch.setattr(dirlayout, "fcntl", fcntl)
        await other.delete("k")  # the last object: its lock files and directories go
        assert not (tmp_path / "ns").exists()
        await other.put("k", b"new", ObjectMeta.of(b"new", 1, 0o600, version=2))
        monkeypatch.setattr(dirlayout, "fcntl", Paused())
        go.set()
    assert len(calls) == 2, "the removed lock file was taken again"
    assert got["removed"] is False  # it holds version 2 now
    assert (await other.get("k"))[0] == b"new"
    for s in (store, other):
        await s.aclose()
