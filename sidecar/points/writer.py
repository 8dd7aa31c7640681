"""The restore point writer: a point of the mirrored tree when changes settle, and at the drain;
then retention (the format: :mod:`sidecar.points.format`; the plans: :mod:`sidecar.points.plan`).

A point describes exactly the per-file objects the store holds (key, version, sha256, mode and
mtime, from :class:`~sidecar.known.StoreState`) and holds their bytes, streamed from the disk and
checked to hash to the stored sha256 (:class:`~sidecar.localfs.StoredCopy`). It is written only
while the uploader has nothing pending or running, so the known state is a committed one (for
snapshot roots: a state the disk passed through), and only if every file on disk still holds the
stored bytes; otherwise the changes have not settled and the next tick tries again.

Schedule: at most one point every ``interval`` seconds, when the tree differs from the last
point's; an incremental point (the files changed and deleted since the last point) unless a full
one is due (:func:`~sidecar.points.plan.full_due`: the chain costs more than a full point, or the full
point is ``full_interval`` old). Every put and delete goes through the :class:`~sidecar.writer.Writer`
(a proof of ownership right before each); a point's seq is a version the writer reserved. After
each point, retention lists the points and deletes the expired ones (:func:`~sidecar.points.plan.retention_plan`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import anyio
import anyio.to_thread

from sidecar import log, metrics
from sidecar.fence import Fenced
from sidecar.known import StoreState
from sidecar.localfs import StoredCopy, Unstable, Vanished
from sidecar.paths import Root, split_key
from sidecar.points.format import (
    FULL,
    INCR,
    POINT_DIR,
    PointEntry,
    PointError,
    PointHeader,
    PointName,
    PointReader,
    fits,
    parse_point_key,
    point_source,
)
from sidecar.points.plan import MAX_CHAIN_INCRS, Retention, choose_for_latest, full_due, retention_now, retention_plan
from sidecar.store.base import NotFound, ObjectInfo, ObjectMeta, StoreError
from sidecar.writer import Writer

#: Consecutive unsettled attempts after which a warning says why no point is written.
_UNSETTLED_WARN = 10


@dataclass
class Chain:
    """What the chain the next incremental extends holds: the tree as of its newest point."""

    tree: dict[str, ObjectMeta]
    seq: int  # its newest point
    base: int  # its full point
    full_bytes: int  # the full point object's size
    incr_bytes: int  # its incrementals' sizes
    incrs: int
    full_time: float | None  # store times
    last_time: float | None


@dataclass(frozen=True)
class Written:
    """A point written: its name, files, deletions and object bytes."""

    name: PointName
    files: int
    deleted: int
    size: int


class PointWriter:
    """Writes restore points for ``roots`` from ``known`` through ``writer`` (see the module
    docstring). ``idle()`` says whether the uploader has nothing pending or running and
    ``wait_idle()`` waits for that; ``excluded()`` gives the keys the store keeps but the disk
    does not hold (kept roots' and kept keys': never in a point)."""

    def __init__(self, writer: Writer, roots: list[Root], known: StoreState, *, interval: float,
                 full_interval: float, retention: Retention, idle: Callable[[], bool],
                 wait_idle: Callable[[], Awaitable[None]],
                 excluded: Callable[[], tuple[set[str], set[str]]] = lambda: (set(), set())) -> None:
        self.writer = writer
        self.roots_by_name = {r.name: r for r in roots}
        self.known = known
        self.interval = interval
        self.full_interval = full_interval
        self.retention = retention
        self.idle = idle
        self.wait_idle = wait_idle
        self.excluded = excluded
        self.chain: Chain | None = None
        self._loaded = False
        self._lock = anyio.Lock()
        self._unsettled = 0
        self._warned_large = False
        #: the highest point seq seen (a writer without a fence numbers on from it)
        self._max_seq = 0
        self._culprit: PointName | None = None  # the point being read by _read_chain

    # -- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Every ``interval`` seconds, once the uploader is idle: a point if the tree changed.
        Returns when fenced or released; store errors are logged and tried again next time."""
        if self.interval <= 0:
            return
        while True:
            await anyio.sleep(self.interval)
            await self.wait_idle()
            try:
                await self.write_point()
            except Fenced:
                return
            except StoreError as e:
                log.warning("restore_point_failed", error=str(e))
            except Exception as e:  # never let a bug in a periodic task end the daemon
                log.error("restore_point_failed", exc=e)

    async def final(self) -> Written | None:
        """At the drain: one last point if anything changed since the last (the uploader idle).
        Never raises but for cancellation."""
        if self.interval <= 0:
            return None
        try:
            return await self.write_point(compact=False)  # the drain is bounded: no full point unless needed
        except Fenced:
            return None
        except StoreError as e:
            log.warning("restore_point_failed", error=str(e))
        except Exception as e:
            log.error("restore_point_failed", exc=e)
        return None

    # -- one point --------------------------------------------------------------------------
    def _tree(self) -> tuple[dict[str, ObjectMeta], set[str]] | None:
        """The committed tree now, and the keys of it carried from the last point (None: the
        uploader is busy, nothing has settled).

        A file the store keeps but the disk does not hold as stored (a kept root's, a kept key's, a
        skipped one's) is not written into a point from the disk; but it is not deleted either: the
        entry the last point has for it is carried, so that no point records as deleted what the
        store still holds (a restore of that point, then a sidecar taking its disk for the truth,
        would delete it), when it is of the version the store keeps; with no such entry to carry,
        no point is written (:meth:`_uncovered`)."""
        if not self.idle():
            return None
        kept_roots, kept_keys = self.excluded()
        skipped = self.known.skipped_keys()
        tree: dict[str, ObjectMeta] = {}
        for key, info in self.known.objects_in(set(self.roots_by_name) - kept_roots).items():
            if key in kept_keys or key in skipped or info.sha256 is None:
                continue  # not on disk as stored, or not vouched for by the store: not from the disk
            tree[key] = ObjectMeta(info.size, info.sha256, info.mtime_ns, info.mode & 0o7777, info.version)
        carried: set[str] = set()
        if self.chain is not None:
            for key, meta in self.chain.tree.items():
                if key not in tree and (key in kept_keys or key in skipped or key.partition("/")[0] in kept_roots) \
                        and (stored := self.known.get(key)) is not None and stored.version == meta.version:
                    tree[key] = meta  # the version the store keeps: an older one would be no point of now
                    carried.add(key)
        return tree, carried

    def _uncovered(self, tree: dict[str, ObjectMeta]) -> int:
        """How many files the store keeps (with their sha256) that ``tree`` lacks: kept or skipped
        ones no earlier point holds (a root gone and back, a file unreadable, before the first
        point). A point without them would restore a tree without them."""
        return sum(1 for key, info in self.known.objects_in(set(self.roots_by_name)).items()
                   if key not in tree and info.sha256 is not None)

    async def write_point(self, *, compact: bool = True) -> Written | None:
        """A point of the committed tree if it changed since the last one (then retention); None
        when nothing changed or the changes have not settled. ``compact=False``: an incremental
        point whenever there is a chain to extend (a full one that is due waits for the next
        point). Raises :class:`Fenced`, ``StoreError``."""
        async with self._lock:
            await self.writer.ready()
            if not self._loaded:
                await self._load()
            now = self._tree()
            if now is None:
                self._not_settled("the uploader has work pending")
                return None
            tree, carried = now
            if uncovered := self._uncovered(tree):  # never a point that lacks what the store keeps
                self._not_settled(f"{log.count(uncovered, 'file')} the store keeps are neither on disk nor in an "
                                  "earlier point")
                return None
            if carried:  # their bytes are not on disk: only an incremental point can keep them
                compact = False
            chain = self.chain
            if chain is not None and chain.tree == tree:
                return None
            header = self._plan(tree, chain, compact)
            if carried and header.kind == FULL:
                self._not_settled(f"a full point is due, and {len(carried)} files the store keeps are not on disk")
                return None
            if not fits(header):
                if not self._warned_large:
                    self._warned_large = True
                    log.warning("restore_point_skipped", files=len(header.entries),
                                detail="the tree is larger than a point's header may be; restore works from the "
                                       "per-file objects")
                return None
            data = {e.key: StoredCopy(*self._where(e.key), e.written.size, e.written.sha256) for e in header.files()}
            try:
                source = await anyio.to_thread.run_sync(point_source, header, data)
                meta = ObjectMeta(source.size, source.sha256, time.time_ns(), 0o600)
                key = header.name.key
                info = await self.writer.put(key, source, meta, version=header.seq)
            except (Unstable, Vanished, OSError) as e:
                self._not_settled(f"{log.printable(str(e))} no longer holds its stored bytes")
                return None
            if self.writer.newer(info) or info.size != source.size:
                raise Fenced(f"put {key}: a newer owner's object is stored there")
            self._unsettled = 0
            written = Written(header.name, len(header.files()), len(header.entries) - len(header.files()), source.size)
            self._advance(header, tree, source.size)
            metrics.POINTS.labels(header.kind).inc()
            metrics.POINT_BYTES.inc(source.size)
            log.info("restore_point", kind=header.kind, seq=header.seq, files=written.files, deleted=written.deleted,
                     bytes=source.size)
            await self._retain()
            return written

    def _not_settled(self, why: str) -> None:
        self._unsettled += 1
        if self._unsettled == _UNSETTLED_WARN:
            log.warning("restore_point_waiting", attempts=self._unsettled, detail=f"not written: {why}")
        else:
            log.debug("restore_point_waiting", detail=why)

    def _where(self, key: str) -> tuple[Root, list[str]]:
        root, parts = split_key(key, self.roots_by_name)
        return root, parts

    def _plan(self, tree: dict[str, ObjectMeta], chain: Chain | None, compact: bool = True) -> PointHeader:
        seq = self.writer.reserve_version() or self._max_seq + 1
        self._max_seq = max(self._max_seq, seq)
        if chain is not None:
            changed = [PointEntry(k, m) for k, m in sorted(tree.items()) if k not in chain.tree or chain.tree[k] != m]
            gone = [PointEntry(k, None) for k in sorted(chain.tree.keys() - tree.keys())]
            age = (chain.last_time - chain.full_time) if chain.last_time is not None and chain.full_time is not None else 0.0
            due = full_due(full_bytes=chain.full_bytes, incr_bytes=chain.incr_bytes + sum(e.written.size for e in changed),
                           incrs=chain.incrs, full_age=age, full_interval=self.full_interval,
                           tree_bytes=sum(m.size for m in tree.values()))
            if not due or (not compact and chain.incrs < MAX_CHAIN_INCRS):
                return PointHeader(INCR, seq, chain.base, chain.seq, tuple(changed + gone))
        return PointHeader(FULL, seq, seq, seq, tuple(PointEntry(k, m) for k, m in sorted(tree.items())))

    def _advance(self, header: PointHeader, tree: dict[str, ObjectMeta], size: int) -> None:
        c = self.chain
        if header.kind == FULL or c is None:
            self.chain = Chain(tree, header.seq, header.seq, size, 0, 0, None, None)
        else:
            self.chain = Chain(tree, header.seq, c.base, c.full_bytes, c.incr_bytes + size, c.incrs + 1,
                               c.full_time, c.last_time)

    # -- the store's points -------------------------------------------------------------------
    async def _list(self) -> dict[PointName, ObjectInfo]:
        out = {}
        async for info in self.writer.list(POINT_DIR + "/"):
            name = parse_point_key(info.key)
            if name is not None:
                out[name] = info
                self._max_seq = max(self._max_seq, name.seq)
        return out

    async def _load(self) -> None:
        """The newest usable chain in the store, its headers read (not its files): the next point
        extends it. Anything unreadable: the next point is a full one."""
        self._loaded = True
        listed = await self._list()
        unusable: list[PointName] = []
        for _ in range(3):  # the newest chain, or after an unreadable point the one before it
            points = choose_for_latest(listed, unusable)
            if not points:
                return
            try:
                self.chain = await self._read_chain(points, listed)
                return
            except (PointError, NotFound) as e:
                log.warning("restore_point_unreadable", error=str(e),
                            detail="the next restore point is a full one")
                unusable.append(self._culprit or points[-1])
        self.chain = None

    async def _read_chain(self, points: tuple[PointName, ...], listed: dict[PointName, ObjectInfo]) -> Chain | None:
        tree: dict[str, ObjectMeta] = {}
        prev = None
        for p in points:
            self._culprit = p
            async with await self.writer.get_stream(p.key) as (_, chunks):
                h = await PointReader(chunks).header(p)
            if p.kind == INCR and h.prev != prev:
                raise PointError(f"unreadable point: {p.key!r} does not follow the point before it")
            if p.kind == FULL:
                tree = {}
            for e in h.entries:
                if e.meta is None:
                    tree.pop(e.key, None)
                else:
                    tree[e.key] = e.meta
            prev = p.seq
        full = listed[points[0]]
        incr_bytes = sum(listed[p].size for p in points[1:])
        last = listed[points[-1]]
        if len(points) - 1 >= MAX_CHAIN_INCRS:
            return None
        return Chain(tree, points[-1].seq, points[0].seq, full.size, incr_bytes, len(points) - 1,
                     full.modified, last.modified)

    async def _retain(self) -> None:
        """Delete the expired points (each delete proves ownership); the store's time of the
        newest point is now. Errors are logged: the next point's retention tries again."""
        try:
            listed = await self._list()
            times = {n: i.modified for n, i in listed.items()}
            now = retention_now(times)
            if now is None:
                return
            c = self.chain
            if c is not None:
                newest = max(listed) if listed else None
                if newest is not None and newest.seq == c.seq:  # our last point's store time
                    c.last_time = times[newest]
                    if c.full_time is None:
                        full = next((n for n in listed if n.seq == c.base), None)
                        c.full_time = times.get(full) if full is not None else None
            metrics.LAST_POINT.set(now)
            for name in retention_plan(times, now, self.retention):
                await self.writer.delete(name.key)
                metrics.POINT_DELETES.inc()
                log.debug("restore_point_deleted", key=name.key)
        except StoreError as e:
            log.warning("restore_point_retention_failed", error=str(e))

