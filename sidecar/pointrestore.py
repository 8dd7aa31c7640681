"""Restoring from restore points (:mod:`sidecar.points`; docs/RESTORE.md, "Restoring from a point").

* The latest state (:class:`PointFeed`, driven by the restorer): the newest usable chain's points
  are opened and their headers read while the namespace is listed; every listed file whose
  (version, size, sha256) equals its entry in the chain's tree is taken from the point
  (:func:`~sidecar.restoreplan.from_point`), the rest are fetched from their objects as before.
  Each opened point is streamed once, a member at a time, from while the listing goes on: a
  member waits for its key's offer, and the taken files are written as their bytes arrive
  (verified per entry; small ones in batches on worker threads). A point that turns out
  unreadable part way (corrupt, cut short, gone) costs one warning: the files it did not place
  are fetched from their objects. Listed is the truth: a key the chain has but the listing has
  not was deleted after the point and is never restored.
* ``restore --as-of`` (:func:`restore_as_of`): the tree of the newest point at or before a time
  (store clock), its chain applied, bytes from the points only; read newest point first, one
  stream at a time, so that each key's newest entry decides it. Reads only.
* ``history`` (:func:`list_points`, :func:`read_header`): the points and their headers.
"""

from __future__ import annotations

import datetime
import errno
import math
import os
import re
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import anyio
import anyio.abc
import anyio.to_thread

from sidecar import log
from sidecar.localfs import UnsafeTarget, has_regular_files
from sidecar.log import rfc3339
from sidecar.paths import IgnoreRules, Root, UnsafeKey, is_within, split_key
from sidecar.points import (
    POINT_DIR,
    POINT_MANIFEST,
    PointEntry,
    PointError,
    PointHeader,
    PointName,
    PointReader,
    choose_as_of,
    choose_for_latest,
    encode_header,
    link_error,
    parse_point_key,
)
from sidecar.restorefs import (
    Aside,
    CannotSetAside,
    ChecksumMismatch,
    Lineage,
    OpenDirs,
    RestoreTemp,
    aside_parent,
    clear_restoring,
    mark_restoring,
    plan_aside,
    remove_stale_restore_temps,
    restore_cut_short,
    set_aside,
    syncfs,
    write_lineage,
    write_restored,
)
from sidecar.restoreplan import as_of_refused, as_of_time, chain_tree, from_point, holding_point
from sidecar.retry import retry_transient
from sidecar.snapshot import BundleError
from sidecar.store.base import NotFound, ObjectInfo, Store, StoreError
from sidecar.tarstream import BLOCK, member_header, pad

#: The latest state opens a chain's full point and at most this many of its newest increments
#: while the store is listed (each held open, a chunk buffered, until the listing ends); the
#: others are read once it has ended, only those that should hold a listed file's version.
MAX_INCREMENTS_READ = 7
#: Chunks (CHUNK_BYTES each) fetched ahead while a point is read: the next chunk arrives while
#: one is written out (more in flight gained nothing measurable, and each costs a chunk of
#: memory per open point: (1 + 1) x (1 + MAX_INCREMENTS_READ) chunks at most).
READ_AHEAD = 1
#: Files up to this size are written on the event loop (as the restorer does).
INLINE_WRITE_MAX = 256 * 1024


#: Small files taken from a point are written in worker threads, a batch at a time (at most
#: BATCH_FILES files or BATCH_BYTES bytes a batch, WRITE_BATCHES batches in flight): creating files
#: is most of a restore of small files, and it then overlaps the point's download and itself. The
#: bytes waiting to be written stay under (1 + WRITE_BATCHES) x BATCH_BYTES.
BATCH_FILES = 64
BATCH_BYTES = 1024 * 1024
WRITE_BATCHES = 4


@dataclass
class Small:
    """A small file whose bytes were read and checked (its point's entry sha256), to be placed."""

    root: Root
    parts: list[str]
    info: ObjectInfo
    data: bytes


def write_batch(batch: list[Small]) -> list[Exception | None]:
    """Blocking: place each file of ``batch`` (:func:`~sidecar.restorefs.write_restored`), its
    directories opened once; per file None, or the :class:`~sidecar.localfs.UnsafeTarget` or
    ``OSError`` that kept it out (the files after an ``OSError`` are not tried: their outcome is it too)."""
    dirs = OpenDirs()
    out: list[Exception | None] = []
    try:
        for i, s in enumerate(batch):
            try:
                write_restored(s.root, s.parts, s.data, s.info.mtime_ns, s.info.mode, None, dirs)
                out.append(None)
            except UnsafeTarget as e:
                out.append(e)
            except OSError as e:
                return out + [e] * (len(batch) - i)
    finally:
        dirs.close()
    return out


class BatchWriter:
    """Writes :class:`Small` files in worker threads, a batch at a time, in ``tg``; ``done`` is
    called on the event loop with each file and its outcome (None: placed). :meth:`add` waits while
    WRITE_BATCHES batches are being written; :meth:`flush` hands over the last one."""

    def __init__(self, tg: anyio.abc.TaskGroup, done: Callable[[Small, Exception | None], None]) -> None:
        self._tg, self._done = tg, done
        self._pending: list[Small] = []
        self._bytes = 0
        self._slots = anyio.Semaphore(WRITE_BATCHES)

    async def add(self, small: Small) -> None:
        self._pending.append(small)
        self._bytes += len(small.data)
        if len(self._pending) >= BATCH_FILES or self._bytes >= BATCH_BYTES:
            await self.flush()

    async def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending, self._bytes = self._pending, [], 0
        await self._slots.acquire()
        self._tg.start_soon(self._write, batch)

    async def _write(self, batch: list[Small]) -> None:
        try:
            outcomes = await anyio.to_thread.run_sync(write_batch, batch)
        finally:
            self._slots.release()
        for small, outcome in zip(batch, outcomes, strict=True):
            self._done(small, outcome)


class AsOfError(Exception):
    """``restore --as-of`` cannot fill the roots (one line: no point at or before the time, a root
    holds files, a point unreadable)."""


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
    """The fewest bytes a whole point of ``header`` takes (as :func:`~sidecar.points.point_chunks`
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
        await close_stream(chunks)
        raise


async def read_header(store: Store, name: PointName) -> PointHeader:
    """Only the header of a point (its first member); the rest of the object is not read."""
    opened = await open_point(store, name)
    await close_stream(opened.chunks)
    return opened.header


async def close_stream(chunks: AsyncIterator[bytes]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


def _unusable(name: PointName, error: Exception) -> None:
    log.warning("restore_point_unusable", point=name.key, error=log.printable(str(error)),
                detail="this restore point is not used: the files it would give come from their own objects")


#: What the restorer does with one file taken from a point: place it from ``body`` (its root, its
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
                    _unusable(name, e)
                    bad.append(name)
                    if self.opened:  # the full and the increments before the bad one: still a chain
                        self.incrs = [q.seq for q in chain[1:] if q.seq < name.seq]
                        self.unread = {q: p for q, p in self.unread.items() if q < name.seq}
                        break
            self.tree = chain_tree(o.header.entries for o in self.opened)
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
        should hold its version (:func:`~sidecar.restoreplan.holding_point`)."""
        self.offered.add(info.key)
        self._offers.set()
        self._offers = anyio.Event()
        held = self.tree.get(info.key)
        merging = root.name in self.merging
        if held is not None and from_point(info, held[1], merging=merging, max_file_size=self.max_file_size):
            self.taken[info.key] = (root, info)
            return True
        seq = holding_point(info.version, self.incrs) if self.unread else None
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
            await self._offers.wait()  # (set, and replaced, at each offer and at the listing's end)

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
                _unusable(opened.name, e)
            finally:
                await close_stream(opened.chunks)

        async def later(seq: int, files: dict[str, tuple[Root, ObjectInfo]], limit: anyio.Semaphore) -> None:
            async with limit:
                name = self.unread[seq]
                try:
                    opened = await open_point(self.store, name, READ_AHEAD)
                except (PointError, StoreError) as e:
                    _unusable(name, e)
                    return
                try:
                    async for entry, body in opened.reader.files():
                        got = files.get(entry.key)
                        if got is not None and from_point(got[1], entry, merging=False, max_file_size=self.max_file_size):
                            await place(got[0], got[1], body)
                            done.add(entry.key)
                except (PointError, BundleError, StoreError) as e:
                    _unusable(name, e)
                finally:
                    await close_stream(opened.chunks)

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
            await close_stream(opened.chunks)
        self.opened = []


# -- restore --as-of -----------------------------------------------------------------------------


async def _first_unreadable(store: Store, chain: tuple[PointName, ...],
                            headers: list[PointHeader]) -> PointName | None:
    """The first point of ``chain`` that is unreadable, cut short, or does not follow the point
    before it (its ``prev``: a chain missing a point gives a wrong tree); warned. The headers
    read are added to ``headers``."""
    before = None
    headers.clear()
    for name in chain:
        try:
            header = await read_header(store, name)
            if (broken := link_error(header.prev, before)) is not None:
                raise PointError(broken)
        except (PointError, NotFound) as e:
            _unusable(name, e)
            return name
        headers.append(header)
        before = name
    return None


@dataclass
class AsOfResult:
    """What ``restore --as-of`` did: the point restored (and its time), files and bytes placed,
    and (``--force-restore``) what each root held that the point lacks, moved beside it."""

    point: PointName
    time: float | None
    files: int = 0
    bytes: int = 0
    refused: int = 0
    aside: list[Aside] = field(default_factory=list)


async def store_now(store: Store) -> float | None:
    """The store's current time: its own clock when it tells it (``Store.now``), else the newest
    Last-Modified of the namespace's objects (one listing); None when it holds none."""
    now = getattr(store, "now", None)
    if now is not None:
        return float(await now())
    return max([i.modified async for i in store.list() if i.modified is not None], default=None)


async def restore_as_of(store: Store, roots: list[Root], when: float | None, ago: float | None, *,
                        force: bool, lineage: Lineage, ignore: IgnoreRules | None = None,
                        deadline: float = 0.0) -> AsOfResult:
    """Fill ``roots`` with the namespace as it was at ``when`` (or ``ago`` seconds before the
    store's now): the newest point at or before it, its chain applied. Roots holding files are
    refused unless ``force``, which makes each root equal the point's tree: what a root holds
    that the point lacks (ignored names aside) is moved into a directory beside it
    (:func:`_set_aside`), the point's files written over the rest. Reads only the store; each root
    gets the restore marker before its first change and, once its files are flushed, ``lineage``
    (this namespace's disk from now on: a sidecar started on it mirrors it). :class:`AsOfError`
    when it cannot."""
    ignore = ignore or IgnoreRules()
    has_files = {r.name: await anyio.to_thread.run_sync(has_regular_files, r.path, ignore) for r in roots}
    refused = as_of_refused(has_files, force)
    if refused:
        paths = ", ".join(r.path for r in roots if r.name in refused)
        raise AsOfError(f"refusing to restore as of a time into roots that hold files ({paths}); "
                        "--force-restore makes them equal the point (what it lacks is moved beside them)")
    points = await list_points(store, deadline)
    t = when if when is not None else as_of_time(when, ago, await store_now(store))
    if t is None:
        raise AsOfError("the store's current time is not known (it holds no object with a time): give the time "
                        "as RFC 3339 instead of a duration ago")
    # to the millisecond, as history shows them: the time a point is listed with selects it
    times = {n: None if i.modified is None else math.floor(i.modified * 1000) / 1000 for n, i in points.items()}
    bad: list[PointName] = []
    headers: list[PointHeader] = []
    while chosen := choose_as_of(times, t, bad):  # every point of the chain checked before a file is written
        if (failed := await _first_unreadable(store, chosen, headers)) is None:
            break
        bad.append(failed)
    if not chosen:
        known = [i.modified for i in points.values() if i.modified is not None]
        oldest = f"the oldest is at {rfc3339(min(known))}" if known else "the namespace has none"
        unusable = f"; unusable: {', '.join(b.key for b in bad)}" if bad else ""
        raise AsOfError(f"no restore point at or before {rfc3339(t)} in {store.description} ({oldest}{unusable})")
    target = chosen[-1]
    result = AsOfResult(target, points[target].modified)
    by_name = {r.name: r for r in roots}
    for root in roots:
        await anyio.to_thread.run_sync(remove_stale_restore_temps, root)
    started: dict[str, Root] = {}
    if force:
        tree = chain_tree(h.entries for h in headers)
        await _set_aside(roots, set(tree), ignore, started, result)
    decided: set[str] = set()  # keys a newer point of the chain decided (written or deleted)
    dirs = OpenDirs()
    try:
        for name in reversed(chosen):  # newest first: each key's newest entry decides it
            try:
                opened = await open_point(store, name, READ_AHEAD)
            except (PointError, NotFound) as e:
                raise AsOfError(f"restore point {name.key} is unreadable: {e}{_again(started)}") from None
            except StoreError as e:
                raise AsOfError(f"cannot read restore point {name.key}: {_once(e)}{_again(started)}") from None
            try:
                fresh = {e.key for e in opened.header.entries if e.key not in decided}
                decided |= fresh
                async for entry, body in opened.reader.files():
                    if entry.key in fresh:
                        await _place_as_of(entry, body, by_name, started, dirs, result)
            except PointError as e:
                raise AsOfError(f"restore point {name.key} is unreadable: {e}{_again(started)}") from None
            except StoreError as e:  # (on Azure: the point changed while it was read)
                raise AsOfError(f"restore point {name.key} could not be read to its end: {_once(e)}"
                                f"{_again(started)}") from None
            finally:
                await close_stream(opened.chunks)
    finally:
        dirs.close()
    for root in roots:  # every file in place: flushed, recorded as this namespace's, marker removed
        if root.name in started:
            await anyio.to_thread.run_sync(syncfs, root.path)
        try:
            await anyio.to_thread.run_sync(write_lineage, root, lineage)
        except FileNotFoundError:
            pass  # the point holds nothing of it: recorded before its first upload
        except OSError as e:
            log.warning("lineage_unrecorded", root=root.path, error=e.strerror or type(e).__name__,
                        detail="the next start takes this root for a new disk and merges it from the store")
        clear_restoring(root)
    return result


async def _set_aside(roots: list[Root], tree: set[str], ignore: IgnoreRules, started: dict[str, Root],
                     result: AsOfResult) -> None:
    """Move what each root holds that the point's ``tree`` lacks into a directory beside it
    (:func:`~sidecar.restorefs.set_aside`): every root is planned before any is changed (a root
    that cannot be: AsOfError, nothing changed), then each root gets its restore marker and its
    moves. A run cut short keeps the marker; run again, it moves what is left (into a new directory)."""
    plans = []
    real = [os.path.realpath(r.path) for r in roots]
    for root in roots:
        keep = {k.split("/", 1)[1] for k in tree if k.startswith(root.name + "/")}
        try:
            plans.append(aside := await anyio.to_thread.run_sync(plan_aside, root, keep, ignore))
        except CannotSetAside as e:
            raise AsOfError(f"{e} (nothing was changed)") from None
        if aside.paths and any(is_within(aside_parent(root), r) for r in real):  # (a root reached through a link)
            raise AsOfError(f"cannot move what {log.printable(root.path)} holds that the point lacks beside it: "
                            f"{log.printable(aside_parent(root))} lies in a root (nothing was changed)")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")  # a name only
    for aside in plans:
        if not aside.paths:
            continue
        root = aside.root
        marked = restore_cut_short(root)
        try:
            mark_restoring(root)
        except OSError as e:
            raise AsOfError(f"cannot write into {root.path}: {e.strerror}{_again(started)}") from None
        try:
            await anyio.to_thread.run_sync(set_aside, aside, stamp)
        except CannotSetAside as e:
            if e.moved == 0 and not marked:
                clear_restoring(root)  # this root as it was
            else:
                started[root.name] = root
            if not started:
                raise AsOfError(f"{e} (nothing was changed)") from None
            raise AsOfError(f"{e} ({e.moved} entries were moved there){_again(started)}") from None
        started[root.name] = root
        result.aside.append(aside)
        log.info("restore_as_of_set_aside", root=root.path, into=log.printable(aside.into), entries=aside.moved)


#: ``restore --as-of --force-restore`` names at most this many of the entries it moved out of a root.
SHOWN_ASIDE = 20


def aside_line(aside: Aside, shown: int = SHOWN_ASIDE) -> str:
    """What was moved out of a root, in one line: how many entries, where to, and the first
    ``shown`` of their paths (sorted, escaped; a directory with a trailing ``/``)."""
    paths = sorted(aside.paths)
    names = ", ".join(log.printable(p) for p in paths[:shown])
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return (f"moved {aside.moved} {'entry' if aside.moved == 1 else 'entries'} the point lacks out of "
            f"{log.printable(aside.root.path)} into {log.printable(aside.into)}: {names}{more}")


def _again(started: dict[str, Root]) -> str:
    """What an as-of restore that failed after changing a root leaves, and how to finish it (a
    plain rerun is refused when the roots hold files; a forced one moves aside what is left)."""
    if not started:
        return ""
    return (" (the roots keep their restore marker and the files placed or moved aside so far: run it again "
            "with --force-restore)")


def _once(e: StoreError) -> str:
    """A store error's text for a command that does not retry it (no "will retry")."""
    return re.sub(r";? will retry( later)?$", "", str(e))


async def _place_as_of(entry: PointEntry, body: AsyncIterator[bytes], by_name: dict[str, Root],
                       started: dict[str, Root], dirs: OpenDirs, result: AsOfResult) -> None:
    """Write one file of the as-of tree into its root (never outside it), verified against its entry."""
    first = entry.key.split("/", 1)[0]
    if first not in by_name:
        return  # a root not configured here
    try:
        root, parts = split_key(entry.key, by_name)
    except UnsafeKey as e:
        log.error("restore_refused_name", path=log.no_surrogates(entry.key), reason=str(e))
        result.refused += 1
        return
    if root.name not in started:
        try:
            mark_restoring(root)
        except OSError as e:
            raise AsOfError(f"cannot write into {root.path}: {e.strerror}") from None
        started[root.name] = root
    m = entry.written
    try:
        if m.size <= INLINE_WRITE_MAX:
            data = b"".join([chunk async for chunk in body])  # checked against m.sha256 as it arrived
            write_restored(root, parts, data, m.mtime_ns, m.mode, None, dirs)
        else:
            await write_streamed(root, parts, body, ObjectInfo(entry.key, m.size, m.sha256, m.mtime_ns, m.mode),
                                 m.sha256)
    except UnsafeTarget as e:
        log.error("restore_refused_target", path=entry.key, reason=str(e))
        result.refused += 1
        return
    except ChecksumMismatch:
        raise PointError(f"entry {entry.key!r} does not match its sha256") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise AsOfError(f"no space left on device while restoring into {root.path} (no partial file left; "
                            "the roots keep their restore marker)") from None
        raise AsOfError(f"cannot write {entry.key} into {root.path}: {e.strerror}") from None
    result.files += 1
    result.bytes += m.size


async def write_streamed(root: Root, parts: list[str], chunks: AsyncIterator[bytes], got: ObjectInfo,
                         expected: str | None) -> None:
    """Write a large object as its chunks arrive (each write in a worker thread), then verify and
    place it (:class:`~sidecar.restorefs.RestoreTemp`); nothing is left behind on failure."""
    temp = await anyio.to_thread.run_sync(RestoreTemp, root, parts)
    try:
        async for chunk in chunks:
            await anyio.to_thread.run_sync(temp.write, chunk)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(temp.abort)
        raise
    await anyio.to_thread.run_sync(temp.finish, got.mtime_ns, got.mode, expected)
