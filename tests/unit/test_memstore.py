"""The memory store's hooks (pause, fail the n-th call, crash after the n-th mutation, the log),
its clock, and the parts of its rules the store contract does not reach (streamed puts, swaps,
``delete_if``, a dropped container), the last checked op for op against the directory store."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import anyio
import pytest

from sidecar.store.base import NotFound, ObjectMeta, StoreError, TransientStoreError
from sidecar.store.directory import DirectoryStore
from tests.memstore import Crashed, FakeClock, MemorySpace, Mutation

pytestmark = pytest.mark.anyio


def meta(data: bytes, version: int = 1) -> ObjectMeta:
    return ObjectMeta.of(data, 1_700_000_000_000_000_000, 0o640, version)


@dataclass
class Chunks:
    """A Source of ``parts``; ``changed``: its read raises after the last chunk, as a file that
    changed since it was hashed does."""

    parts: list[bytes]
    changed: bool = False

    @property
    def size(self) -> int:
        return sum(map(len, self.parts))

    @property
    def md5(self) -> bytes:
        return hashlib.md5(b"".join(self.parts)).digest()

    def iter_sync(self) -> Iterator[bytes]:
        yield from self.parts
        if self.changed:
            raise OSError("changed while read")

    async def chunks(self) -> AsyncIterator[bytes]:
        for part in self.iter_sync():
            yield part


async def test_a_paused_request_waits_for_its_event_and_others_go_by():
    space = MemorySpace()
    store = space.store("ns")
    gate = space.hooks.pause("put", key=lambda k: k.startswith(".sidecar/"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.put, ".sidecar/owner", b"m", meta(b"m"))
        await gate.reached.wait()
        assert gate.waiting == 1
        await store.put("r/x", b"x", meta(b"x"))  # another key: not held
        with pytest.raises(NotFound):
            await store.get(".sidecar/owner")  # held before it did anything
        gate.open()
    assert (await store.get(".sidecar/owner"))[0] == b"m"
    assert [str(m) for m in space.log] == ["put r/x v1", "put .sidecar/owner v1"]
    assert (gate.waiting, gate.passed) == (0, 1)


async def test_a_request_paused_after_it_landed_is_seen_before_its_caller_hears():
    space = MemorySpace()
    a, b = space.store("ns"), space.store("ns")
    release = anyio.Event()
    gate = space.hooks.pause("delete_if", "r/x", release, when="after")
    await a.put("r/x", b"x", meta(b"x", version=3))
    answers: list[bool] = []

    async def delete() -> None:
        answers.append(await a.delete_if("r/x", 3))

    async with anyio.create_task_group() as tg:
        tg.start_soon(delete)
        await gate.reached.wait()
        assert [i.key async for i in b.list()] == [] and not answers  # landed; not yet answered
        release.set()
    assert answers == [True]


async def test_the_nth_call_of_an_op_fails_and_only_that_one():
    space = MemorySpace()
    store = space.store()
    await store.put("r/a", b"a", meta(b"a"))
    await store.put("r/b", b"b", meta(b"b"))
    space.hooks.fail("get", 2, TransientStoreError("throttled"), key="r/a")
    assert (await store.get("r/a"))[0] == b"a"
    assert (await store.get("r/b"))[0] == b"b"  # not a matching key: not counted
    with pytest.raises(TransientStoreError, match="throttled"):
        await store.get("r/a")
    assert (await store.get("r/a"))[0] == b"a"
    space.hooks.fail("put", 1, TransientStoreError("busy"))
    with pytest.raises(TransientStoreError):
        await store.put("r/a", b"new", meta(b"new", version=2))
    assert (await store.get("r/a"))[0] == b"a" and len(space.log) == 2  # a failed put changes nothing


async def workload(store) -> None:
    """Five mutations that land (and a superseded put and a missing delete, which change nothing)."""
    await store.put("r/a", b"1", meta(b"1", version=1))
    await store.put("r/b", b"2", meta(b"2", version=2))
    await store.put("r/a", b"0", meta(b"0", version=0))  # superseded
    await store.delete("r/missing")
    await store.put("r/a", b"3", meta(b"3", version=3))
    await store.delete("r/b")
    assert await store.delete_if("r/a", 3)


async def test_a_crash_after_each_mutation_leaves_exactly_the_ones_before_it():
    whole = MemorySpace()
    await workload(whole.store("ns"))
    assert [str(m) for m in whole.log] == ["put r/a v1", "put r/b v2", "put r/a v3", "delete r/b", "delete_if r/a"]
    for k in range(len(whole.log)):
        space = MemorySpace()
        space.hooks.crash_after(k)
        store = space.store("ns")
        with pytest.raises(Crashed):
            await workload(store)
        assert space.log == whole.log[:k], k
        assert space.hooks.crashed
        assert len([i async for i in store.list()]) <= 2 and await store.exists()  # reads still work
        with pytest.raises(Crashed):
            await store.delete("r/a")
        space.hooks.clear()  # the restart
        await store.delete("r/a")
        assert not space.hooks.crashed


async def test_the_log_holds_what_each_mutation_wrote():
    space = MemorySpace()
    store = space.store("ns")
    await store.put("r/s", Chunks([b"ab", b"cd"]), meta(b"abcd", version=4), if_version=0)
    assert space.log == [Mutation("put", "r/s", b"abcd", meta(b"abcd", version=4), 0, prefix="ns")]


async def test_a_streamed_put_is_read_whole_and_refused_when_its_source_fails():
    space = MemorySpace()
    store = space.store()
    info = await store.put("r/s", Chunks([b"one", b"two"]), meta(b"onetwo", version=2))
    assert info.size == 6 and (await store.get("r/s"))[0] == b"onetwo"
    with pytest.raises(OSError, match="changed"):
        await store.put("r/s", Chunks([b"three"], changed=True), meta(b"three", version=3))
    data, info = await store.get("r/s")
    assert data == b"onetwo" and info.version == 2 and len(space.log) == 1


async def test_the_store_clock_is_the_fake_clock_and_etags_change_on_every_write():
    clock = FakeClock()
    space = MemorySpace(clock)
    store = space.store()
    assert await store.now() == clock.time() == clock.epoch
    first = await store.put("r/x", b"x", meta(b"x"))
    clock.advance(7.5)
    again = await store.put("r/x", b"x", meta(b"x"))  # the same bytes and metadata
    assert again.etag != first.etag and again.modified == first.modified + 7.5
    assert (await store.get("r/x"))[1] == again
    assert [i async for i in store.list()] == [again]
    await clock.sleep(2.5)
    assert clock() == clock.monotonic() == 10.0 and await store.now() == clock.epoch + 10.0
    clock.advance(-5)  # never goes back
    assert clock.now == 10.0


async def test_a_dropped_container_is_not_there_until_a_store_opens_it():
    space = MemorySpace()
    store = space.store("ns")
    await store.put("r/x", b"x", meta(b"x"))
    space.drop()
    assert not await store.exists()
    assert [i async for i in store.list()] == []
    with pytest.raises(StoreError, match="not there"):
        await store.put("r/x", b"x", meta(b"x"))
    await space.store("ns", create=False).open()  # a read-only store makes nothing
    assert not await store.exists()
    await store.open()
    assert await store.exists()
    await store.put("r/x", b"x", meta(b"x"))


@pytest.mark.parametrize("seed", range(4))
async def test_every_answer_is_the_directory_stores(tmp_path, seed):
    """The same random puts (versions, swaps), deletes and conditional deletes on both stores: the
    same answers, op for op, and the same objects at the end."""
    rng = random.Random(seed)
    disk = DirectoryStore(str(tmp_path / "store"), "ns")
    await disk.open()
    mem = MemorySpace().store("ns")

    def summary(info) -> tuple:
        return (info.key, info.size, info.sha256, info.mtime_ns, info.mode, info.version)

    for step in range(150):
        key = f"r/{rng.choice('abc')}"
        op = rng.choice(["put", "put", "put", "swap", "delete", "delete_if", "get"])
        version = rng.choice([0, 1, 2, 3, 5, 8, 2**63 - 1])  # the last: not one a sidecar writes
        data = f"{step}".encode()
        if op in ("put", "swap"):
            if_version = rng.choice([0, 1, 2, 3, 5, 8]) if op == "swap" else None
            answers = [summary(await s.put(key, data, meta(data, version), if_version)) for s in (disk, mem)]
        elif op == "delete":
            answers = [await s.delete(key) for s in (disk, mem)]
        elif op == "delete_if":
            answers = [await s.delete_if(key, version) for s in (disk, mem)]
        else:
            answers = []
            for s in (disk, mem):
                try:
                    got, info = await s.get(key)
                    answers.append((got, summary(info)))
                except NotFound:
                    answers.append(None)
        assert answers[0] == answers[1], (step, op, key, version)
    listed = [sorted([summary(i) async for i in s.list()]) for s in (disk, mem)]
    assert listed[0] == listed[1]
