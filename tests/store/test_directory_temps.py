"""The directory store's clean-up of a crashed writer's temp files touches its own namespace only,
and there only dead writers' temps: many sessions share one store, a namespace nested below this
one's prefix (``a/s1`` below ``a``, or ``a/agent/s2``) is another sidecar's, and another writer of
the same namespace (a second sidecar, a command) may be streaming a large file meanwhile: their
in-flight temp files must survive. A dead writer's (no ``flock`` on it, and old by the store's
clock) goes."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from sidecar.marker import OWNER_KEY
from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore
from sidecar.store.dirfs import TMP_PREFIX

pytestmark = pytest.mark.anyio

STAMP = 1_700_000_000_000_000_000


class _Held:
    """A streamed source that, once its temp file is open, waits for ``release`` before its bytes."""

    def __init__(self, data: bytes, writing: threading.Event, release: threading.Event) -> None:
        self.data, self.size, self.md5 = data, len(data), hashlib.md5(data).digest()
        self.writing, self.release = writing, release

    def iter_sync(self):
        self.writing.set()
        assert self.release.wait(10), "never released"
        yield self.data

    async def chunks(self):  # pragma: no cover - the directory store reads iter_sync
        yield self.data


def temps(where: Path) -> list[str]:
    return sorted(str(p.relative_to(where)) for p in where.rglob(TMP_PREFIX + "*"))


def crashed(path: Path, seconds_ago: int = 3600) -> Path:
    """A temp file a writer left when it died ``seconds_ago`` (no lock on it; the store is this
    machine's disk, so its clock is this machine's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"crashed")
    then = time.time_ns() - seconds_ago * 10**9
    os.utime(path, ns=(then, then))
    return path


def age(where: Path) -> None:
    """Make every temp file below ``where`` an hour old: a long upload, or one whose mtime the
    put has set to the file's own already; only its writer's lock tells it is alive."""
    for p in where.rglob(TMP_PREFIX + "*"):
        crashed_at = time.time_ns() - 3600 * 10**9
        os.utime(p, ns=(crashed_at, crashed_at))


async def test_a_parent_prefix_never_removes_a_nested_namespaces_temp_files(tmp_path):
    base = tmp_path / "store"
    nested = DirectoryStore(str(base), "a/s1")
    await nested.open()
    marker = b'{"generation": 1}'
    await nested.put(OWNER_KEY, marker, ObjectMeta.of(marker, 5, 0o600, version=5))  # its claim
    deeper = DirectoryStore(str(base), "a/agent/s2")
    await deeper.open()
    await deeper.put(OWNER_KEY, marker, ObjectMeta.of(marker, 5, 0o600, version=5))
    # another live writer's temp files in the deeper namespace (its data and its records)
    for where in (base / "a/agent/s2/.checkpoints", base / "a/agent/s2/.sidecar-meta/.checkpoints"):
        where.mkdir(parents=True)
        (where / f"{TMP_PREFIX}0123456789ab").write_bytes(b"in flight")
    # a crash's leftovers in the parent's own namespace, its records and its own objects
    own = [base / "a/.checkpoints" / f"{TMP_PREFIX}aaaaaaaaaaaa", base / "a/.sidecar-meta" / f"{TMP_PREFIX}bbbbbbbbbbbb",
           base / "a/agent/notes" / f"{TMP_PREFIX}cccccccccccc"]
    for leftover in own:
        crashed(leftover)

    data = b"a paused workflow " * 1000
    writing, release = threading.Event(), threading.Event()
    got: dict = {}

    async def nested_put() -> None:
        got["info"] = await nested.put(".checkpoints/ctx/c.json", _Held(data, writing, release),
                                       ObjectMeta.of(data, STAMP, 0o600, version=1))

    parent = DirectoryStore(str(base), "a")
    await parent.open()
    async with anyio.create_task_group() as tg:
        tg.start_soon(nested_put)
        try:
            assert await anyio.to_thread.run_sync(writing.wait, 10), "the nested put never started streaming"
            assert temps(base / "a/s1"), "the nested put's temp file"
            await parent.put(".checkpoints/x.json", b"x", ObjectMeta.of(b"x", STAMP, 0o600, version=1))  # it cleans
            left = temps(base / "a/s1")
        finally:
            release.set()
    assert left, "the parent's first put removed a nested namespace's in-flight temp file"
    assert got["info"].version == 1
    assert (await nested.get(".checkpoints/ctx/c.json"))[0] == data
    assert temps(base / "a/agent/s2") == [f".checkpoints/{TMP_PREFIX}0123456789ab",
                                          f".sidecar-meta/.checkpoints/{TMP_PREFIX}0123456789ab"]
    assert not any(p.exists() for p in own), "the parent's own leftovers are still removed"
    assert temps(base / "a/s1") == []
    for s in (nested, deeper, parent):
        await s.aclose()


async def held_put(store: DirectoryStore, key: str, data: bytes, writing: threading.Event,
                   release: threading.Event, got: dict) -> None:
    got["info"] = await store.put(key, _Held(data, writing, release), ObjectMeta.of(data, STAMP, 0o600, version=1))


@pytest.mark.parametrize("where", ["same namespace", "unclaimed nested namespace"])
async def test_a_first_put_never_removes_another_live_writers_temp_however_old(tmp_path, where):
    """The other writer streams a large file (its temp kept open, gated by an event) and its temp
    is made an hour old; the first writer's first put runs meanwhile. Its clean-up removes the
    dead writer's leftover beside it, never the live one's: the upload lands whole."""
    base = tmp_path / "store"
    other = DirectoryStore(str(base), "a" if where == "same namespace" else "a/s1")  # s1: not claimed yet
    await other.open()
    dead = crashed(base / "a/.checkpoints" / f"{TMP_PREFIX}0123456789ab")
    data = b"a large upload " * 10_000
    writing, release, got = threading.Event(), threading.Event(), {}
    first = DirectoryStore(str(base), "a")
    await first.open()
    async with anyio.create_task_group() as tg:
        tg.start_soon(held_put, other, ".checkpoints/big.bin", data, writing, release, got)
        try:
            assert await anyio.to_thread.run_sync(writing.wait, 10), "the other put never started streaming"
            age(base / "a")
            in_flight = [t for t in temps(base / "a") if t != f".checkpoints/{TMP_PREFIX}0123456789ab"]
            assert in_flight, "the other put's temp file"
            await first.put(".checkpoints/x.json", b"x", ObjectMeta.of(b"x", STAMP, 0o600, version=1))  # it cleans
            left = temps(base / "a")
        finally:
            release.set()
    assert in_flight[0] in left, "the first writer's first put removed a live writer's temp file"
    assert not dead.exists(), "a dead writer's temp file is removed"
    assert got["info"].version == 1
    assert (await other.get(".checkpoints/big.bin"))[0] == data
    assert temps(base / "a") == []
    for s in (other, first):
        await s.aclose()


async def test_a_new_temp_no_writer_holds_is_kept_until_it_is_old(tmp_path):
    """Between a temp's creation and its writer's lock there is an instant: a temp younger than
    the grace is kept whoever holds it; an old one nobody holds is a dead writer's."""
    base = tmp_path / "store"
    young = base / "a" / f"{TMP_PREFIX}0123456789ab"
    young.parent.mkdir(parents=True)
    young.write_bytes(b"just made")
    old = crashed(base / "a" / "deep" / f"{TMP_PREFIX}ba9876543210")
    store = DirectoryStore(str(base), "a")
    await store.open()
    await store.put(".checkpoints/x.json", b"x", ObjectMeta.of(b"x", STAMP, 0o600, version=1))
    assert young.exists() and not old.exists()
    await store.aclose()


async def test_a_dead_writers_temp_dated_ahead_is_removed(tmp_path):
    """A put gives its temp the source file's mtime, which may be years ahead: a dead writer's
    temp so dated is not new (it was kept for ever); one made this instant is spared."""
    base = tmp_path / "store"
    ahead = crashed(base / "a/.checkpoints" / f"{TMP_PREFIX}0123456789ab", seconds_ago=-10 * 365 * 86400)
    just_made = crashed(base / "a/.checkpoints" / f"{TMP_PREFIX}ba9876543210", seconds_ago=0)
    store = DirectoryStore(str(base), "a")
    await store.open()
    await store.put(".checkpoints/x.json", b"x", ObjectMeta.of(b"x", STAMP, 0o600, version=1))  # it cleans
    await store.aclose()
    assert not ahead.exists() and just_made.exists()
