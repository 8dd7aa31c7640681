"""Restore points written by a running sidecar, and by the point writer alone, on both stores
(a directory, and Azurite through the real store client).

A point's entries must describe exactly the per-file objects the store holds; a full point comes
first and when due, incrementals in between, a last one at the drain; retention deletes through
the writer only what no kept point needs, and a fenced writer deletes nothing.
"""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import anyio
import pytest

from sidecar.fence import Fence, Fenced
from sidecar.known import StoreState
from sidecar.paths import Root
from sidecar.points.format import FULL, INCR, POINT_DIR, PointHeader, PointName, parse_point_key, read_point
from sidecar.points.plan import Retention
from sidecar.points.writer import PointWriter
from sidecar.store.base import NotFound, ObjectInfo, ObjectMeta
from sidecar.writer import Writer
from support import wait_for, write_atomic
from tests.integration.fencekit import KINDS, Target, make_target


@pytest.fixture(params=KINDS)
def target(request, tmp_path):
    yield from make_target(request, tmp_path)


Points = list[tuple[PointName, ObjectInfo, PointHeader, dict]]


def stored(target: Target, prefix: str = "") -> tuple[dict[str, ObjectInfo], Points]:
    """The per-file objects of ``.checkpoints`` and every point (its header and files), oldest first."""

    async def go():
        store = target.store(prefix)
        await store.open()
        try:
            objects, points = {}, []
            async for info in store.list(""):
                name = parse_point_key(info.key)
                if name is not None:
                    try:
                        async with await store.get_stream(info.key) as (_, chunks):
                            header, files = await read_point(chunks)
                    except NotFound:  # deleted by retention since the listing
                        continue
                    assert header.matches(name)
                    points.append((name, info, header, files))
                elif info.key.startswith(".checkpoints/"):
                    objects[info.key] = info
            return objects, sorted(points, key=lambda p: p[0])
        finally:
            await store.aclose()

    return anyio.run(go)


def tree_of(points: list, upto: PointName) -> dict[str, tuple[int, str]]:
    """The tree (key -> (version, sha256)) a chain gives up to ``upto``."""
    tree: dict[str, tuple[int, str]] = {}
    for name, _, h, _ in points:
        if name.seq > upto.seq or name.base != upto.base:
            continue
        for e in h.entries:
            if e.meta is None:
                tree.pop(e.key, None)
            else:
                tree[e.key] = (e.meta.version, e.meta.sha256)
    return tree


def matches_store(objects: dict[str, ObjectInfo], points: list) -> bool:
    newest = points[-1][0]
    return tree_of(points, newest) == {k: (i.version, i.sha256) for k, i in objects.items()}


def test_a_running_sidecar_writes_a_full_point_then_incrementals_then_one_at_the_drain(target, tmp_path):
    work = tmp_path / "work"
    cp = work / ".checkpoints"
    write_atomic(cp / "r1" / "a.json", b"a1")
    write_atomic(cp / "r1" / "b.json", b"b1" * 1000)
    sc = target.start(work, "sync", env=target.env(SIDECAR_RESTORE_POINT_INTERVAL="0.2"))
    sc.wait_event("ready")
    wait_for(lambda: (s := stored(target))[1] and matches_store(*s), 20, "a first point of the mirrored tree")
    objects, points = stored(target)
    assert [p[0].kind for p in points] == [FULL]
    assert points[0][3] == {".checkpoints/r1/a.json": b"a1", ".checkpoints/r1/b.json": b"b1" * 1000}
    assert sc.wait_event("restore_point")["kind"] == "full"

    write_atomic(cp / "r1" / "a.json", b"a2")
    (cp / "r1" / "b.json").unlink()
    wait_for(lambda: (s := stored(target))[1] and ".checkpoints/r1/b.json" not in s[0] and s[0]
             and matches_store(*s), 20, "an incremental point of the change")
    objects, points = stored(target)
    name, _, h, files = points[-1]
    assert name.kind == INCR and name.base == points[0][0].seq and h.prev == points[-2][0].seq
    assert files == {".checkpoints/r1/a.json": b"a2"}
    assert [e.key for e in h.entries if e.deleted] == [".checkpoints/r1/b.json"]
    assert all(p[0].base == points[0][0].seq for p in points)  # one chain: no full was due

    write_atomic(cp / "r1" / "c.json", b"c1")
    assert sc.stop() == 0, sc.log()[-3000:]
    objects, points = stored(target)
    assert ".checkpoints/r1/c.json" in objects, sc.log()[-4000:]
    assert matches_store(objects, points)


def test_the_drain_writes_the_last_point_even_before_the_interval(target, tmp_path):
    work = tmp_path / "work"
    write_atomic(work / ".checkpoints" / "r1" / "a.json", b"a1")
    sc = target.start(work, "sync", env=target.env(SIDECAR_RESTORE_POINT_INTERVAL="3600"))
    sc.wait_event("ready")
    wait_for(lambda: ".checkpoints/r1/a.json" in stored(target)[0], 20, "the file stored")
    assert stored(target)[1] == []  # not yet due
    assert sc.stop() == 0, sc.log()[-3000:]
    objects, points = stored(target)
    assert [p[0].kind for p in points] == [FULL] and matches_store(objects, points)


def test_no_points_when_disabled(target, tmp_path):
    work = tmp_path / "work"
    write_atomic(work / ".checkpoints" / "r1" / "a.json", b"a1")
    sc = target.start(work, "sync", env=target.env(SIDECAR_RESTORE_POINT_INTERVAL="0"))
    sc.wait_event("ready")
    wait_for(lambda: ".checkpoints/r1/a.json" in stored(target)[0], 20, "the file stored")
    assert sc.stop() == 0
    assert stored(target)[1] == []


def test_a_full_point_when_due_and_retention_keeps_only_what_the_newest_needs(target, tmp_path):
    work = tmp_path / "work"
    cp = work / ".checkpoints"
    write_atomic(cp / "r1" / "a.json", b"a0")
    env = target.env(SIDECAR_RESTORE_POINT_INTERVAL="0.2", SIDECAR_RESTORE_POINT_FULL_INTERVAL="2",
                     SIDECAR_RESTORE_POINT_KEEP_ALL="0", SIDECAR_RESTORE_POINT_KEEP_HOURLY="0",
                     SIDECAR_RESTORE_POINT_KEEP_DAILY="0")
    sc = target.start(work, "sync", env=env)
    sc.wait_event("ready")
    n = [0]
    fulls_seen: set[int] = set()

    def a_later_full_and_the_first_chain_gone() -> bool:
        n[0] += 1
        write_atomic(cp / "r1" / f"f{n[0] % 5}.json", b"x" * n[0])  # a change at every look
        _, points = stored(target)
        names = [p[0] for p in points]
        # at every look: every incremental's chain is whole (retention never cuts a needed point)
        fulls = {p.seq for p in names if p.kind == FULL}
        fulls_seen.update(fulls)
        for p, _, h, _ in points:
            if p.kind == INCR:
                assert p.base in fulls, names
                chain = [q.seq for q in names if q.base == p.base and q.seq < p.seq]
                assert h.prev == chain[-1], names
        return len(fulls_seen) >= 2 and min(fulls_seen) not in fulls

    wait_for(a_later_full_and_the_first_chain_gone, 40, "a second full point, and the first chain deleted")
    assert sc.stop() == 0, sc.log()[-3000:]
    objects, points = stored(target)
    assert len({p[0].base for p in points}) <= 2 and matches_store(objects, points)


# -- the point writer alone -------------------------------------------------------------------
class Rig:
    """A point writer over a root on disk and the store of ``target``, its per-file objects put
    through the same writer (so the known state is the store's)."""

    def __init__(self, target: Target, tmp_path: Path, **kw) -> None:
        self.target = target
        self.root = Root(".checkpoints", str(tmp_path / "disk" / ".checkpoints"))
        os.makedirs(self.root.path, exist_ok=True)
        self.kw = kw

    async def __aenter__(self) -> Rig:
        self.store = self.target.store("")
        await self.store.open()
        self.fence = Fence(self.store, window=0.01, margin=0)
        self.writer = Writer(self.store, self.fence)
        await self.writer.claim()
        self.known = StoreState()
        kw = {"interval": 1.0, "full_interval": 86400.0, "retention": Retention(0, 0, 0), **self.kw}
        self.points = PointWriter(self.writer, [self.root], self.known, idle=lambda: True, wait_idle=_nothing, **kw)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.store.aclose()

    async def put(self, rel: str, data: bytes) -> None:
        path = Path(self.root.path, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        key = f".checkpoints/{rel}"
        info = await self.writer.put(key, data, ObjectMeta.of(data, path.stat().st_mtime_ns, 0o644))
        self.known.stored(key, info)

    async def put_big(self, rel: str, size: int) -> None:
        """A file of ``size`` bytes, written and stored in chunks (never held whole)."""
        import hashlib

        from sidecar.localfs import hash_stable

        path = Path(self.root.path, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        with open(path, "wb") as f:
            for i in range(size // (1 << 20)):
                block = bytes([i % 251]) * (1 << 20)
                digest.update(block)
                f.write(block)
        source, meta = hash_stable(self.root, rel.split("/"), 1 << 40)
        key = f".checkpoints/{rel}"
        self.known.stored(key, await self.writer.put(key, source, meta))

    async def point_names(self) -> list[PointName]:
        return sorted([n async for i in self.store.list(POINT_DIR + "/") if (n := parse_point_key(i.key))])


async def _nothing() -> None:
    return None


def test_retention_through_a_fenced_writer_deletes_nothing(target, tmp_path):
    async def go():
        async with Rig(target, tmp_path, retention=Retention()) as rig:  # keeps everything (young)
            await rig.put("r/a", b"one")
            await rig.points.write_point()
            await rig.put("r/a", b"two")
            await rig.points.write_point()
            rig.points.chain = None
            await anyio.sleep(1.1)  # store times have a resolution of a second (Azure)
            await rig.put("r/a", b"three")
            assert (await rig.points.write_point()).name.kind == FULL
            before = await rig.point_names()
            assert len(before) == 3

            newer_store = target.store("")
            await newer_store.open()
            try:
                await Fence(newer_store, window=0.01, margin=0).claim()
                with anyio.fail_after(5):  # a write within the old owner's last proof is its right
                    while rig.fence.clock() < rig.fence.valid_until:
                        await anyio.sleep(0.005)
                rig.points.retention = Retention(0, 0, 0)  # the first chain has expired ...
                with pytest.raises(Fenced):
                    await rig.points._retain()
            finally:
                await newer_store.aclose()
            assert await rig.point_names() == before  # ... and nothing was deleted

    anyio.run(go)


def test_retention_deletes_the_expired_chain_and_keeps_the_newest(target, tmp_path):
    async def go():
        async with Rig(target, tmp_path, full_interval=0.0) as rig:
            await rig.put("r/a", b"one")
            first = (await rig.points.write_point()).name
            await rig.put("r/a", b"two")
            await rig.points.write_point()
            rig.points.chain = None  # the next point is a full one
            await anyio.sleep(1.1)  # store times have a resolution of a second (Azure)
            await rig.put("r/a", b"three")
            newest = (await rig.points.write_point()).name
            assert newest.kind == FULL
            names = await rig.point_names()
            assert names == [newest] and first not in names

    anyio.run(go)


def test_a_file_whose_disk_bytes_differ_from_the_stored_ones_is_not_settled(target, tmp_path):
    async def go():
        async with Rig(target, tmp_path) as rig:
            await rig.put("r/a", b"stored")
            Path(rig.root.path, "r/a").write_bytes(b"newer!")  # not uploaded yet
            assert await rig.points.write_point() is None
            assert await rig.point_names() == []
            await rig.put("r/a", b"newer!")
            assert (await rig.points.write_point()) is not None

    anyio.run(go)


def test_a_tree_larger_than_a_header_may_be_gets_no_point(target, tmp_path, monkeypatch, caplog):
    import sidecar.points.format

    monkeypatch.setattr(sidecar.points.format, "MAX_POINT_ENTRIES", 3)

    async def go():
        async with Rig(target, tmp_path) as rig:
            for i in range(4):
                await rig.put(f"r/{i}", b"x")
            assert await rig.points.write_point() is None
            assert await rig.point_names() == []

    anyio.run(go)


def test_a_point_streams_its_files_memory_stays_bounded(target, tmp_path):
    size = 48 << 20

    async def go():
        async with Rig(target, tmp_path) as rig:
            await rig.put_big("r/big", size)
            tracemalloc.start()
            try:
                written = await rig.points.write_point()
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert written is not None and written.size > size
            assert peak < 24 << 20, peak  # a few chunks, never the file

    anyio.run(go)


def test_no_point_while_the_uploader_has_work_the_committed_state_only(target, tmp_path):
    async def go():
        busy = [True]
        async with Rig(target, tmp_path) as rig:
            rig.points.idle = lambda: not busy[0]
            await rig.put("r/a", b"one")
            assert await rig.points.write_point() is None  # a commit may be half applied
            assert await rig.point_names() == []
            busy[0] = False
            assert (await rig.points.write_point()).files == 1
            assert await rig.points.write_point() is None  # nothing changed since
            assert len(await rig.point_names()) == 1

    anyio.run(go)


def test_a_restarted_writer_extends_the_stored_chain(target, tmp_path):
    async def go():
        async with Rig(target, tmp_path, retention=Retention()) as rig:
            await rig.put("r/big", b"B" * 100_000)  # so that a full point costs more than a few incrementals
            await rig.put("r/a", b"one")
            full = (await rig.points.write_point()).name
            await rig.put("r/b", b"two")
            incr = (await rig.points.write_point()).name
        async with Rig(target, tmp_path, retention=Retention()) as again:  # a new sidecar: known from a listing
            async for info in again.store.list(".checkpoints/"):
                again.known.stored(info.key, info)
            assert await again.points.write_point() is None  # the stored chain already holds this tree
            await again.put("r/a", b"three")
            w = await again.points.write_point()
            assert (w.name.kind, w.name.base, w.files) == (INCR, full.seq, 1) and w.name.seq > incr.seq
            assert again.points.chain is not None and again.points.chain.incrs == 2

    anyio.run(go)


def test_the_drains_point_extends_the_chain_even_when_a_full_one_is_due(target, tmp_path):
    async def go():
        async with Rig(target, tmp_path, retention=Retention()) as rig:
            await rig.put("r/a", b"one")
            full = (await rig.points.write_point()).name
            await rig.put("r/a", b"two" * 10_000)  # more than the full point: a full one is due
            w = await rig.points.final()
            assert (w.name.kind, w.name.base) == (INCR, full.seq)
            await rig.put("r/a", b"three" * 10_000)
            assert (await rig.points.write_point()).name.kind == FULL  # the next one compacts

    anyio.run(go)
