"""Restore points read (:mod:`sidecar.points`; docs/RESTORE.md, "Restoring from a point").

* The latest state (:class:`PointFeed`, a source of :mod:`.latest`): the newest usable chain's
  points are opened and their headers read while the namespace is listed; every listed file whose
  (version, size, sha256) equals its entry in the chain's tree is taken from the point
  (:func:`~sidecar.restore.plan.point_source`), the rest are fetched from their objects as before.
  Each opened point is streamed once, a member at a time, from while the listing goes on: a
  member waits for its key's offer, and the taken files are handed to the placer as their bytes
  arrive (verified per entry). A point that turns out unreadable part way (corrupt, cut short,
  gone) costs one warning: the files it did not place are fetched from their objects. Listed is
  the truth: a key the chain has but the listing has not was deleted after the point and is never
  restored.
* ``restore --as-of`` (:mod:`.asof`) and ``history``/``verify``: :func:`list_points`,
  :func:`open_point`, :func:`read_header`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import anyio

from sidecar import log
from sidecar.paths import Root
from sidecar.points.format import (
    POINT_DIR,
    POINT_MANIFEST,
    PointEntry,
    PointError,
    PointHeader,
    PointName,
    PointReader,
    encode_header,
    parse_point_key,
)
from sidecar.points.plan import choose_for_latest
from sidecar.restore import plan
from sidecar.retry import retry_transient
from sidecar.snapshot import BundleError
from sidecar.store.base import NotFound, ObjectInfo, Store, StoreError, close_chunks
from sidecar.tarstream import BLOCK, member_header, pad

#: The latest state opens a chain's full point and at most this many of its newest increments
#: while the store is listed (each held open, a chunk buffered, until the listing ends); the
#: others are read once it has ended, only those that should hold a listed file's version.
MAX_INCREMENTS_READ = 7
#: Chunks (CHUNK_BYTES each) fetched ahead while a point is read: the next chunk arrives while
#: one is written out (more in flight gained nothing measurable, and each costs a chunk of
#: memory per open point: (1 + 1) x (1 + MAX_INCREMENTS_READ) chunks at most).
READ_AHEAD = 1


async def list_points(store: Store, deadline: float = 0.0) -> dict[PointName, ObjectInfo]:
    """The namespace's restore points by name (names that do not parse are left out), with their
    objects' info (``modified``: the point's time). One listing of ``.sidecar/points/``."""
    out: dict[PointName, ObjectInfo] = {}

    async def once() -> None:
        out.clear()
        async for info in store.list(POINT_DIR + "/"):
            name = parse_point_key(info.key)
            if name is not None:
                out[name] = info

    await retry_transient(once, "list restore points", deadline)
    return out


@dataclass
class Opened:
    """A point being read: its name, reader (header read and checked) and stream."""

    name: PointName
    header: PointHeader
    reader: PointReader
    chunks: AsyncIterator[bytes]


def _member_bytes(key: str, size: int, mode: int, mtime_ns: int) -> int:
    """The bytes a member takes in a point: its tar header (512 bytes unless its name or values
    need a pax header), its bytes and their padding."""
    plain = key.isascii() and len(key) <= 100 and 0 <= size < 8**11 and 0 <= mtime_ns // 10**9 < 8**11
    return (BLOCK if plain else len(member_header(key, size, mode, mtime_ns))) + size + len(pad(size))


def least_size(header: PointHeader) -> int:
    """The fewest bytes a whole point of ``header`` takes (as :func:`~sidecar.points.format.point_chunks`
    writes it, with at least one end-of-archive block): a smaller object was cut short, and is
    never used, found before any of its bytes is."""
    n = len(encode_header(header))
    return (_member_bytes(POINT_MANIFEST, n, 0o600, 0) + BLOCK
            + sum(_member_bytes(e.key, e.written.size, e.written.mode, e.written.mtime_ns) for e in header.files()))


async def open_point(store: Store, name: PointName, read_ahead: int = 0,
                     tap: Callable[[ObjectInfo, AsyncIterator[bytes]], AsyncIterator[bytes]] | None = None) -> Opened:
    """One GET: the point's stream, its header read and checked against its name and against the
    object's size (PointError: unusable). ``read_ahead``: chunks fetched ahead as it is read
    (:meth:`~sidecar.store.base.Store.get_stream`). ``tap``: wraps the object's info and chunks
    (``verify`` hashes the whole object as the reader reads it); closing it closes them."""
    info, chunks = await store.get_stream(name.key, read_ahead)
    if tap is not None:
        chunks = tap(info, chunks)
    reader = PointReader(chunks)
    try:
        header = await reader.header(name)
        if info.size < (least := least_size(header)):
            raise PointError(f"unreadable point: cut short ({info.size} bytes stored, its header needs {least})")
        return Opened(name, header, reader, chunks)
    except BaseException:
        await close_chunks(chunks)
        raise


async def read_header(store: Store, name: PointName) -> PointHeader:
    """Only the header of a point (its first member); the rest of the object is not read."""
    opened = await open_point(store, name)
    await close_chunks(opened.chunks)
    return opened.header


def unusable(name: PointName, error: Exception) -> None:
    log.warning("restore_point_unusable", point=name.key, error=log.printable(str(error)),
                detail="this restore point is not used: the files it would give come from their own objects")


#: What the latest-state restore does with one file taken from a point: place it from ``body`` (its root, its
#: listed info); returns once handled (placed, refused, or decided by the root's bundle).
Place = Callable[[Root, ObjectInfo, AsyncIterator[bytes]], Awaitable[None]]


class PointFeed:
    """The latest state's use of restore points, for one restore: :meth:`prepare` (concurrent
    with the listing; ``known`` is set once the chain's tree is known, or there is none),
    :meth:`take` for each listed file of a root being filled, :meth:`place` once the listing has
    ended: the taken files not placed, to fetch from their objects."""

    def __init__(self, store: Store, merging: frozenset[str], max_file_size: int) -> None:
        self.store = store
        self.merging, self.max_file_size = merging, max_file_size
        self.known = anyio.Event()
        self.opened: list[Opened] = []
        self.tree: dict[str, tuple[int, PointEntry]] = {}
        self.taken: dict[str, tuple[Root, ObjectInfo]] = {}
        #: the chain's increments by seq (all of them) and those not opened (not read before the
        #: listing ends): a listed file written between the full point and the newest increment
        #: comes from the first increment after its version, read afterwards if it was not opened
        self.incrs: list[int] = []
        self.unread: dict[int, PointName] = {}
        self.deferred: dict[int, dict[str, tuple[Root, ObjectInfo]]] = {}
        self.placed = 0
        #: the keys the listing has offered (taken or not) and its end (:meth:`listing_ended`): a
        #: point streamed while the store is listed waits at each member until its key's fate
        #: is known, so a file is written exactly when its own object would have been queued
        self.offered: set[str] = set()
        self.listed = anyio.Event()
        self._offers = anyio.Event()
        self._waiting = 0  # points waiting for an offer: only then is an offer announced

    async def prepare(self, deadline: float) -> None:
        """Choose the newest usable chain (an unreadable point is left out, once, with a warning)
        and open its points (the full first), their headers read."""
        try:
            points = await list_points(self.store, deadline)
            bad: list[PointName] = []
            while chain := choose_for_latest(points, bad):
                chosen = chain[:1] + chain[1:][-MAX_INCREMENTS_READ:]
                self.incrs = [p.seq for p in chain[1:]]
                self.unread = {p.seq: p for p in chain[1:] if p not in chosen}
                try:
                    for name in chosen:
                        self.opened.append(await open_point(self.store, name, READ_AHEAD))
                    break
                except (PointError, NotFound) as e:  # (NotFound: deleted by retention since listed)
                    unusable(name, e)
                    bad.append(name)
                    if self.opened:  # the full and the increments before the bad one: still a chain
                        self.incrs = [q.seq for q in chain[1:] if q.seq < name.seq]
                        self.unread = {q: p for q, p in self.unread.items() if q < name.seq}
                        break
            self.tree = plan.chain_tree(o.header.entries for o in self.opened)
            if self.opened:
                log.info("restore_points", points=",".join(str(o.name.seq) for o in self.opened),
                         files=len(self.tree))
        except StoreError as e:  # the listing will say so if the store is failing
            log.warning("restore_points_unreadable", error=str(e), detail="restoring from the per-file objects")
            await self.close()
        finally:
            self.known.set()

    def take(self, root: Root, info: ObjectInfo) -> bool:
        """Whether ``info`` (a listed file of ``root``, being filled) is restored from a point:
        from an opened one when its entry matches, or deferred to the unread increment that
        should hold its version (:func:`~sidecar.restore.plan.holding_point`)."""
        self.offered.add(info.key)
        if self._waiting:
            self._offers.set()
            self._offers = anyio.Event()
        merging = root.name in self.merging
        if plan.point_source(info, self.tree, merging=merging, max_file_size=self.max_file_size) is not None:
            self.taken[info.key] = (root, info)
            return True
        seq = plan.holding_point(info.version, self.incrs) if self.unread else None
        if seq in self.unread and not merging and info.sha256 is not None and info.size <= self.max_file_size:
            self.deferred.setdefault(seq, {})[info.key] = (root, info)
            return True
        return False

    def listing_ended(self) -> None:
        """The listing has ended (every key offered): a point still waiting reads on."""
        self.listed.set()
        self._offers.set()

    async def _offered(self, key: str, waiting: Callable[[], Awaitable[None]] | None) -> None:
        """Until the listing has offered ``key`` (taken or not), or has ended; ``waiting`` first,
        when it has not."""
        if key not in self.offered and not self.listed.is_set() and waiting is not None:
            await waiting()
        while key not in self.offered and not self.listed.is_set():
            self._waiting += 1
            try:
                await self._offers.wait()  # (set, and replaced, at an offer while waited for, and at the listing's end)
            finally:
                self._waiting -= 1

    async def place(self, place: Place,
                    waiting: Callable[[], Awaitable[None]] | None = None) -> list[tuple[Root, ObjectInfo]]:
        """Stream every opened point, concurrently, through ``place`` for the taken files whose
        bytes it holds, from while the store is still listed (:attr:`listed` set by the caller
        once it has ended): a member waits for its key's offer; one of a merged root, or newer in
        another point of the chain, is passed by. The taken files left unplaced (their point
        unreadable part way), once the listing has ended and every point has been read.
        ``waiting``: called before a member waits for its offer (the caller's writes handed over)."""
        done: set[str] = set()

        async def one(index: int, opened: Opened) -> None:
            try:
                async for entry, body in opened.reader.files():
                    held = self.tree.get(entry.key)
                    if held is None or held[0] != index or entry.key.split("/", 1)[0] in self.merging:
                        continue  # never taken: deleted or newer in another point, or compared with the disk
                    await self._offered(entry.key, waiting)
                    if self.listed.is_set() and not self.taken:
                        break  # nothing of the points is restored: the rest is not read
                    got = self.taken.get(entry.key)
                    if got is not None:
                        await place(got[0], got[1], body)
                        done.add(entry.key)
            except (PointError, BundleError, StoreError) as e:  # (BundleError: a placed file's own check)
                unusable(opened.name, e)
            finally:
                await close_chunks(opened.chunks)

        async def later(seq: int, files: dict[str, tuple[Root, ObjectInfo]], limit: anyio.Semaphore) -> None:
            async with limit:
                name = self.unread[seq]
                try:
                    opened = await open_point(self.store, name, READ_AHEAD)
                except (PointError, StoreError) as e:
                    unusable(name, e)
                    return
                try:
                    async for entry, body in opened.reader.files():
                        got = files.get(entry.key)
                        if got is not None and plan.from_point(got[1], entry, merging=False, max_file_size=self.max_file_size):
                            await place(got[0], got[1], body)
                            done.add(entry.key)
                except (PointError, BundleError, StoreError) as e:
                    unusable(name, e)
                finally:
                    await close_chunks(opened.chunks)

        async with anyio.create_task_group() as tg:
            for i, opened in enumerate(self.opened):
                tg.start_soon(one, i, opened)
        await self.listed.wait()
        if self.deferred:  # a few at a time: each holds a chunk while it streams
            limit = anyio.Semaphore(MAX_INCREMENTS_READ + 1)
            async with anyio.create_task_group() as tg:
                for seq, files in sorted(self.deferred.items()):
                    tg.start_soon(later, seq, files, limit)
        self.placed = len(done)
        held = [t for files in self.deferred.values() for t in files.values()]
        return [t for t in [*self.taken.values(), *held] if t[1].key not in done]

    async def close(self) -> None:
        for opened in self.opened:
            await close_chunks(opened.chunks)
        self.opened = []

