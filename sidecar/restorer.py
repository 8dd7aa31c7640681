"""Rehydrate: bring every stored file of every root back before the host starts.

The listing is streamed: files are queued as each page of it arrives, and ``concurrency``
workers download them meanwhile, so the first files land while the rest of the listing is still
being fetched and parsed.
Each file is downloaded, its sha256 verified, written to a temp file beside its target with the
stored mode and mtime, and renamed into place; directories are walked without following symlinks,
so a stored name can never land outside its root. The restored filesystem is flushed at the end
(``syncfs``; a large restore also as it fills) so a power loss cannot leave empty files that a
later ``sync`` would take for the truth. A root gets a restore marker before its first file and
loses it after the flush, so a restore cut short is known as such. Which roots are restored
follows :func:`sidecar.plan.decide_restore`; a root that is this namespace's disk once the restore
ends gets its lineage record (:func:`record_lineage`), after its files are flushed and before its
marker goes. Every such decision is made by :mod:`sidecar.restoreplan` (pure); this module does
the I/O it says.
"""

from __future__ import annotations

import contextlib
import errno
import math
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Iterable, Sequence

import anyio
import anyio.abc
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream

from sidecar import log, metrics
from sidecar.errors import leaves
from sidecar.listing import Listing
from sidecar.localfs import STREAM_MIN, ByteBudget, UnsafeTarget, body_bytes, has_regular_files, local_matches
from sidecar.paths import IgnoreRules, Root, UnsafeKey, split_key
from sidecar.plan import RootDecision, ShapeConflicts
from sidecar.pointrestore import BatchWriter, PointFeed, Small, write_streamed
from sidecar.restorefs import (
    ChecksumMismatch,
    Lineage,
    OpenDirs,
    clear_restoring,
    mark_restoring,
    read_lineage,
    remove_stale_restore_temps,
    restore_cut_short,
    syncfs,
    write_lineage,
    write_restored,
)
from sidecar.restoreplan import (
    Disk,
    FileAction,
    Finish,
    commits_begun_meanwhile,
    decide_roots,
    file_action,
    foreign,
    foreign_refusal,
    generated_name,
    holds,
    names_generated,
    older_copies,
    pending_held,
    plan_candidates,
    plan_finish,
    stored_counts,
    stored_generation,
)
from sidecar.restoreprogress import Progress, flush_as_it_fills
from sidecar.retry import retry_transient
from sidecar.snapshot import BundleError, Change, close_stream, open_bundle
from sidecar.store.base import NotFound, ObjectInfo, ObjectMeta, Store, StoreError


class RestoreError(Exception):
    """Restore cannot bring the state back; the host must not start."""


#: Unverified files named one by one in the log (the rest are counted in ``restore_done``).
UNVERIFIED_SHOWN = 20
#: Restored files up to this size are written on the event loop, where that costs less than a
#: hand-off to a worker thread and back; larger ones in a worker thread.
INLINE_WRITE_MAX = 256 * 1024

@dataclass
class RestoreResult:
    decisions: list[RootDecision] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    refused: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)  # corrupt objects left out (on_corrupt="skip")
    unverified: int = 0
    generated_names: set[str] = field(default_factory=set)
    #: merged roots' local files whose bytes differed from their stored version: replaced by it
    replaced: list[str] = field(default_factory=list)
    #: merged roots' local files that already held their stored bytes: left as they were
    in_place: int = 0
    #: files placed from restore points (the rest of those restored came from their own objects)
    from_points: int = 0
    #: roots that are this namespace's but do not exist yet: recorded before their first upload
    unrecorded: set[str] = field(default_factory=set)
    #: the generation of the namespace's state: the marker's, or the newest stored if later; a
    #: root's record must be no older for its disk to be held, and the roots recorded carry it
    generation: int = 0

    def restored_roots(self) -> set[str]:
        return {d.name for d in self.decisions if d.restore}


#: A queued file: its root, and what the listing says of it.
_Item = tuple[Root, ObjectInfo]
#: A key's path below its root, one name a part.
_Parts = list[str]


class _Restore:
    """One restore. Two feeders, the store's listing and each candidate root's bundle, queue files
    while ``concurrency`` workers download, verify and place them, so the first files land while
    the listing is still being fetched and parsed."""

    def __init__(self, store: Store, roots: list[Root], candidates: dict[str, Root], result: RestoreResult,
                 on_corrupt: str = "fail", max_file_size: int = 2**63, merging: frozenset[str] = frozenset(),
                 disk: dict[str, Disk] | None = None, mode: str = "auto") -> None:
        self.store = store
        self.disk, self.mode = disk or {}, mode
        #: roots the disk says are held: decided once the listing has ended (an older copy is merged)
        self.pending = pending_held(self.disk, mode)
        self.deferred: dict[str, dict[str, ObjectInfo]] = {}  # their listed files meanwhile
        self.older: list[str] = []  # those found older than the store: merged
        self.feeders: anyio.abc.TaskGroup | None = None  # for the bundles of those merged
        # candidates merged (a local file with the stored bytes is left in place), and the pending
        # roots, merged if older
        merging = merging | self.pending
        self.merging = merging
        self.max_file_size = max_file_size  # larger objects are refused (kept in the store)
        self.on_corrupt = on_corrupt  # "fail": a corrupt object fails the restore; "skip": quarantined
        self.by_name = {r.name: r for r in roots}
        self.candidates = candidates  # roots the disk lets us fill, if anything is stored
        self.result = result
        self.listing = self._new_listing()
        self.started: dict[str, Root] = {}  # roots with their restore marker down: files are coming
        self.queued: set[str] = set()  # keys handed to the workers (a retried listing skips them)
        #: each candidate's bundle by key, once fetched: what a cut-short snapshot commit left
        self.overlays: dict[str, dict[str, Change]] = {}
        self.overlay_known = {name: anyio.Event() for name in {*candidates, *self.pending}}
        self.bundles_read: set[str] = set()  # candidates whose bundle was there when read
        self.bundle_changes: dict[str, list[Change]] = {}  # their headers, as first read
        self.bundle_versions: dict[str, int] = {}  # and the bundle objects' versions
        self.listed = anyio.Event()  # the listing has ended: every key's listed version is known
        self.progress = Progress()
        self.dirs = OpenDirs()  # for the files written here on the event loop, not in threads
        self.bodies = ByteBudget()  # the downloads' bytes in memory
        self.send, self.receive = anyio.create_memory_object_stream[_Item](math.inf)
        self.points = PointFeed(store, merging, max_file_size)
        self.point_writes: BatchWriter | None = None  # a point's small files, while it is streamed

    def _queue(self, root: Root, info: ObjectInfo) -> None:
        self._start(root)
        self.queued.add(info.key)
        self.progress.expect(info.size)
        # every worker has ended (BrokenResourceError): the restore is cancelled or failed, and ends as such
        with contextlib.suppress(anyio.BrokenResourceError):
            self.send.send_nowait((root, info))

    def _start(self, root: Root) -> None:
        if root.name not in self.started:
            try:  # before the root's first file lands: a restore cut short from here on is known as such
                mark_restoring(root)
            except OSError as e:
                raise RestoreError(f"cannot write into {root.path}: {e.strerror}") from None
            self.started[root.name] = root

    async def list(self, deadline: float) -> None:
        """Feed every stored file of a candidate root to the workers as its listing page arrives."""
        async def once() -> None:
            self.listing = self._new_listing()  # a retried listing starts over; queued keys are not queued twice
            self.deferred = {}
            async for info in self.store.list():
                self.listing.add(info, self.by_name)
                if not self.points.known.is_set():  # which files the restore points give
                    await self.points.known.wait()
                self._offer(self.listing.settled())
            self._offer(self.listing.settled(end=True))

        await retry_transient(once, "list", deadline)
        await self._decide_pending(deadline)
        self.listed.set()
        self.points.listing_ended()
        for key, why in self.listing.unsafe:
            log.error("restore_refused_name", path=key, reason=why)
            self.result.refused.append(key)

    async def _decide_pending(self, deadline: float) -> None:
        """The listing has ended: a pending root older than what is stored (:func:`older_copies`)
        is merged, its files (deferred until now) queued and its bundle read, as a candidate's."""
        self.older = older_copies(self.disk, self.pending, self.listing.own_max_version)
        for name in self.older:
            log.warning("lineage_older", root=self.by_name[name].path, generation=self.disk[name].generation,
                        stored_generation=stored_generation(self.listing.own_max_version),
                        detail="this disk's record is of an older generation than the store holds (a copy taken "
                               "before a later compute wrote): not the truth; merged, nothing stored is deleted")
        if self.mode != "auto":
            return
        for name in self.older:
            root = self.by_name[name]
            await anyio.to_thread.run_sync(remove_stale_restore_temps, root)
            self.candidates[name] = root
            assert self.feeders is not None
            self.feeders.start_soon(self.overlay, root, deadline)
            for info in self.deferred.get(name, {}).values():
                if info.key not in self.queued:
                    self._queue(root, info)

    def _new_listing(self) -> Listing:
        """A store whose names are not paths can hold a file and a directory of one name at once:
        its listing goes through the restore's rule for them (:class:`ShapeConflicts`)."""
        return Listing(shapes=ShapeConflicts(in_order=getattr(self.store, "flat_namespace", False)))

    def _offer(self, infos: Iterable[ObjectInfo]) -> None:
        for info in infos:
            name = info.key.split("/", 1)[0]
            if name in self.candidates and info.key not in self.queued:
                if self.points.take(self.candidates[name], info):
                    self.queued.add(info.key)  # placed from its restore point as the point is read
                else:
                    self._queue(self.candidates[name], info)
            elif name in self.pending:
                self.deferred.setdefault(name, {})[info.key] = info

    async def from_points(self, deadline: float) -> None:
        """Open the restore points and read them while the store is listed, placing each file
        taken from them as the listing offers it (:mod:`sidecar.pointrestore`); those they did not
        place are fetched from their objects once the listing has ended and the points are read."""
        if not self.candidates:
            self.points.known.set()
            return
        try:
            await self.points.prepare(deadline)
            async with anyio.create_task_group() as writes:  # every small file written before the rest is queued
                self.point_writes = BatchWriter(writes, self._written)
                left = await self.points.place(self._place_from_point, self.point_writes.flush)
                await self.point_writes.flush()
            for root, info in left:
                self._queue(root, info)
        finally:
            await self.points.close()  # (a restore failing meanwhile leaves none open)
        self.result.from_points = self.points.placed

    async def _place_from_point(self, root: Root, info: ObjectInfo, body: AsyncIterator[bytes]) -> None:
        await self.overlay_known[root.name].wait()
        if self._bundle_wins(root.name, info.key, info):
            return  # the bundle decides it
        if info.size <= INLINE_WRITE_MAX and self.point_writes is not None:  # written in a batch, in a thread
            data = b"".join([chunk async for chunk in body])  # checked against its entry's sha256 as it arrived
            _, parts = split_key(info.key, self.by_name)  # checked when listed
            self._start(root)
            self.progress.expect(info.size)
            if name := generated_name(data):
                self.result.generated_names.add(name)
            await self.point_writes.add(Small(root, parts, info, data))
            return
        meta = ObjectMeta(info.size, info.sha256 or "", info.mtime_ns, info.mode, info.version)
        await self._place_bundled(root, Change(info.key, None, meta), body)

    def _written(self, small: Small, outcome: Exception | None) -> None:
        """A file of a point's batch written (``outcome`` None), or kept out."""
        if outcome is None:
            self.progress.add(small.info.size)
            metrics.restored(small.info.size)
        elif isinstance(outcome, UnsafeTarget):
            self._refused_target(small.info.key, outcome, small.info.size)
        else:
            raise self._write_failed(small.root, small.info.key, outcome)

    def _refused_target(self, key: str, e: UnsafeTarget, size: int) -> None:
        log.error("restore_refused_target", path=key, reason=str(e))
        self.result.refused.append(key)
        self.progress.forget(size)

    def _write_failed(self, root: Root, key: str, e: Exception) -> RestoreError:
        """Why a file could not be written; a full disk says how many landed, never a total."""
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            landed = log.count(self.progress.files, "file")
            return RestoreError(f"no space left on device while restoring into {root.path} ({landed} restored "
                                "before it filled up; no partial file left)")
        return RestoreError(f"cannot write {key} into {root.path}: {getattr(e, 'strerror', None) or e}")

    async def overlay(self, root: Root, deadline: float) -> None:
        """Read the root's bundle, if a snapshot commit was cut short: it holds the newer state of
        the files it names (and their deletion), which replaces their own objects. Its header is
        read first (the workers then skip the files it names), then its files are streamed into
        place, a chunk at a time. A read that fails transiently starts over, skipping the files
        already placed, as long as the bundle is still the same. Only the changes newer than the
        listed objects of their keys apply (:meth:`_bundle_wins`): the bundle's files are placed
        once the listing has ended, and its stream is not held open meanwhile."""
        placed: set[str] = set()

        async def open_checked() -> tuple | None:
            try:
                opened = await open_bundle(self.store, root.name)
            except BundleError as e:
                raise RestoreError(f"the snapshot bundle of {root.path} in {self.store.description} is unreadable: {e}") from None
            seen = None if opened is None else (opened[0].changes, opened[2].version)
            if not self.overlay_known[root.name].is_set():
                self._read_overlay(root, None if opened is None else opened[0].changes,
                                   0 if opened is None else opened[2].version)
            elif seen != (None if root.name not in self.bundles_read else
                          (self.bundle_changes[root.name], self.bundle_versions[root.name])):
                if opened is not None:
                    await close_stream(opened[1])
                raise RestoreError(f"the snapshot bundle of {root.path} in {self.store.description} changed while it "
                                   "was being restored (an older sidecar is still writing); restore again")
            return opened

        async def once() -> None:
            opened = await open_checked()
            if opened is not None and not self.listed.is_set():
                await close_stream(opened[1])
                await self.listed.wait()
                opened = await open_checked()
            if opened is None:
                return
            reader, chunks, _ = opened
            if not placed:
                self._report_older(root)
            try:
                async for c, body in reader.files():
                    if c.key not in placed and self._bundle_wins(root.name, c.key, self.listing.objects.get(c.key)):
                        await self._place_bundled(root, c, body)
                        placed.add(c.key)
            except BundleError as e:
                raise RestoreError(f"the snapshot bundle of {root.path} in {self.store.description} is unreadable: {e}") from None
            finally:
                await close_stream(chunks)

        await retry_transient(once, "get", deadline)

    def _bundle_wins(self, root_name: str, key: str, listed: ObjectInfo | None) -> bool:
        """Whether the root's bundle decides ``key`` rather than its ``listed`` object: it names the
        key, and its version is not below the listed object's (a later writer's object wins; a
        commit's own puts come after its bundle, with its bytes). Equal versions are possible only
        when neither carries one (both written by a release without versions, 0): the bundle
        wins then, as the snapshot protocol of that release needs."""
        overlay = self.overlays.get(root_name)
        if overlay is None or key not in overlay:
            return False
        return listed is None or listed.version <= self.bundle_versions.get(root_name, 0)

    def _report_older(self, root: Root) -> None:
        objects = self.listing.objects
        older = sum(1 for k in self.overlays.get(root.name, ()) if not self._bundle_wins(root.name, k, objects.get(k)))
        if older:
            log.info("restore_bundle_older", root=root.path, changes=older,
                     detail="the bundle's changes to these keys are older than their stored objects: those are restored")

    def _read_overlay(self, root: Root, changes: Sequence[Change] | None, version: int = 0) -> None:
        if changes is not None:
            self.bundles_read.add(root.name)
            self.bundle_changes[root.name] = list(changes)
            self.bundle_versions[root.name] = version
        overlay: dict[str, Change] = {}
        for c in changes or ():
            try:
                owner, _ = split_key(c.key, self.by_name)
                if owner is not root:
                    raise UnsafeKey(f"the bundle of {root.name} names a file of {owner.name}")
            except UnsafeKey as e:  # only a forged bundle can: refused, and it hides no listed file
                log.error("restore_refused_name", path=log.no_surrogates(c.key), reason=str(e))
                self.result.refused.append(c.key)
                continue
            overlay[c.key] = c
        self.overlays[root.name] = overlay
        if changes:
            log.info("restore_bundle", root=root.path, changes=len(overlay))
        self.overlay_known[root.name].set()

    async def _place_bundled(self, root: Root, c: Change, body: AsyncIterator[bytes]) -> None:
        """Write one file of the root's bundle as its bytes arrive (checked by the bundle's reader
        against its sha256 before the file is renamed into place)."""
        _, parts = split_key(c.key, self.by_name)  # checked in _read_overlay
        m = c.written
        self._start(root)
        self.progress.expect(m.size)
        try:
            if m.size <= INLINE_WRITE_MAX:
                data = b"".join([chunk async for chunk in body])  # checked against m.sha256 as it arrived
                write_restored(root, parts, data, m.mtime_ns, m.mode, None, self.dirs)
                if name := generated_name(data):
                    self.result.generated_names.add(name)
            else:
                await write_streamed(root, parts, body, ObjectInfo(c.key, m.size, m.sha256, m.mtime_ns, m.mode), m.sha256)
        except UnsafeTarget as e:
            self._refused_target(c.key, e, m.size)
            return
        except ChecksumMismatch:
            raise BundleError(f"bundle entry {c.key!r} does not match its sha256") from None
        except OSError as e:
            raise self._write_failed(root, c.key, e) from None
        self.progress.add(m.size)
        metrics.restored(m.size)

    async def work(self, receive: MemoryObjectReceiveStream[_Item]) -> None:
        async with receive:
            async for root, info in receive:
                async with self.bodies.hold(body_bytes(info.size)):  # memory bounded by design
                    await self._place(root, info)

    def _superseded(self, root: Root, info: ObjectInfo) -> bool:
        """The root's bundle decides the file (its newer version is queued on its own, or it was
        deleted): then the file is not restored after all."""
        if not self._bundle_wins(root.name, info.key, info):
            return False
        self.progress.forget(info.size)
        return True

    async def _place(self, root: Root, info: ObjectInfo) -> None:
        """Restore one listed file as :func:`~sidecar.restoreplan.file_action` says."""
        _, parts = split_key(info.key, self.by_name)  # checked when queued
        action = file_action(info.size, self.max_file_size)
        if action is FileAction.WRITE and root.name in self.merging:  # only a file that may be written is compared
            same = await anyio.to_thread.run_sync(local_matches, root, parts, info.size, info.sha256)
            action = file_action(info.size, self.max_file_size, same)
        if action is FileAction.REFUSE_TOO_LARGE:
            log.error("restore_refused_too_large", path=info.key, size=info.size, limit=self.max_file_size,
                      detail="larger than SIDECAR_MAX_FILE_SIZE: not restored, kept in the store")
            self.result.refused.append(info.key)
            self.progress.forget(info.size)
            return
        if action is FileAction.IN_PLACE:
            self.result.in_place += 1
            self.progress.forget(info.size)
            return
        streamed = info.size > STREAM_MIN  # too large to hold: written as it arrives, a chunk at a time
        placed = await self._fetch(root, info, parts, streamed)
        if placed is None:
            return
        size, data = placed
        if names_generated(info.key, streamed):
            name = generated_name(data)
            if name:
                self.result.generated_names.add(name)
        if action is FileAction.REPLACE:
            self.result.replaced.append(info.key)
            log.warning("restore_replaced_local", path=info.key,
                        detail="this disk's file differed from its stored version and the disk holds no record that "
                               "this namespace filled it: replaced by the stored version (its bytes were not uploaded)")
        self.progress.add(size)
        metrics.restored(size)

    async def _fetch(self, root: Root, info: ObjectInfo, parts: _Parts, streamed: bool) -> tuple[int, bytes] | None:
        """Download, verify and place one file (a second try when its bytes do not match): the
        size placed and its bytes (b"" when ``streamed``). None when it is not placed: superseded
        by its root's bundle, vanished, refused, or quarantined."""
        data = b""
        for attempt in (1, 2):
            if self._superseded(root, info):  # the bundle is known already: no download
                return None
            try:
                if streamed:
                    got, chunks = await self.store.get_stream(info.key)
                else:
                    data, got = await self.store.get(info.key)
            except NotFound:
                log.warning("restore_vanished", path=info.key)
                return None
            # Downloads do not wait for the root's bundle to be read (a round trip, usually
            # a "not found"); writes do.
            await self.overlay_known[root.name].wait()
            if self._superseded(root, info):
                if streamed:
                    await chunks.aclose()  # type: ignore[attr-defined]
                return None
            expected = got.sha256 or info.sha256
            if expected is None and attempt == 1:
                self.result.unverified += 1
                if self.result.unverified <= UNVERIFIED_SHOWN:
                    log.warning("restore_unverified", path=info.key,
                                detail="no sha256 is recorded for it (written by another tool, or a put cut "
                                       "short): restored as stored, unchecked")
            try:
                if streamed:
                    await write_streamed(root, parts, chunks, got, expected)
                # Verified, written and renamed: a large file in a worker thread (hashing
                # 100 MiB in the event loop would stall the other downloads), a small one
                # right here, where it costs less than the hand-off to a thread and back.
                elif len(data) > INLINE_WRITE_MAX:
                    await anyio.to_thread.run_sync(write_restored, root, parts, data, got.mtime_ns, got.mode, expected)
                else:
                    write_restored(root, parts, data, got.mtime_ns, got.mode, expected, self.dirs)
                break
            except ChecksumMismatch:
                log.warning("restore_checksum_mismatch", path=info.key, attempt=attempt)
            except UnsafeTarget as e:
                log.error("restore_refused_target", path=info.key, reason=str(e))
                self.result.refused.append(info.key)
                return None
            except OSError as e:
                raise self._write_failed(root, info.key, e) from None
        else:
            if self.on_corrupt != "skip":
                raise RestoreError(f"{info.key}: stored bytes do not match their sha256 (corrupt object in "
                                   f"{self.store.description}); SIDECAR_RESTORE_CORRUPT=skip starts without it")
            log.error("restore_corrupt_object_quarantined", path=info.key,
                      detail="stored bytes do not match their sha256: not restored, kept in the store untouched "
                             "(never deleted) until the host writes that file again")
            self.result.quarantined.append(info.key)
            self.progress.forget(info.size)
            metrics.quarantined()
            return None
        return (got.size, b"") if streamed else (len(data), data)

    def stored(self) -> dict[str, int]:
        """Files stored per root, with the bundles' changes applied."""
        objects = self.listing.objects
        bundled = {name: {key: c.deleted for key, c in overlay.items() if self._bundle_wins(name, key, objects.get(key))}
                   for name, overlay in self.overlays.items()}
        return stored_counts(self.by_name, objects, bundled)


async def restore(
    store: Store,
    roots: list[Root],
    *,
    mode: str = "auto",
    concurrency: int = 16,
    deadline: float = 0.0,
    on_corrupt: str = "fail",
    max_file_size: int = 2**63,
    namespace: str = "",
    ignore: IgnoreRules | None = None,
    marker_generation: int = 0,
) -> tuple[Listing, RestoreResult]:
    """Restore by the rule (:func:`sidecar.plan.decide_restore`) while the store is listed; the
    listing (the store's content, for mirroring) and what was restored. A listing or bundle read
    that fails transiently is retried until ``deadline`` (monotonic; by default not at all). An
    object whose bytes do not match their recorded sha256 fails the restore (``on_corrupt="fail"``)
    or is left out and reported in ``RestoreResult.quarantined`` (``"skip"``). ``namespace``
    names, with the store's description, the lineage (:func:`lineage_of`) the roots are checked
    against and recorded with; ``marker_generation``, the generation of the namespace's owner
    marker read before the restore: a root is held only when its record's generation is no older
    (:func:`~sidecar.restoreplan.holds`), and the roots recorded now carry it. Files ``ignore`` says
    are never mirrored (by default, the default rules) do not make a root hold files."""
    t0 = time.monotonic()
    result = RestoreResult()
    lineage = lineage_of(store, namespace, marker_generation)
    # Which roots may be filled depends on the disk alone; whether anything is stored for them
    # is known when the listing ends, and a root gets its restore marker with its first file.
    disk = {root.name: await _read_disk(root, lineage, ignore) for root in roots}
    plan = plan_candidates(disk, mode)
    candidates = {r.name: r for r in roots if r.name in plan.roots}
    for root in candidates.values():
        await anyio.to_thread.run_sync(remove_stale_restore_temps, root)

    run = _Restore(store, roots, candidates, result, on_corrupt, max_file_size, plan.merging, disk, mode)
    try:
        async with anyio.create_task_group() as flushing:
            flushing.start_soon(flush_as_it_fills, run.progress, run.started)
            async with anyio.create_task_group() as workers:
                for _ in range(concurrency):
                    workers.start_soon(run.work, run.receive.clone())
                run.receive.close()
                async with run.send:  # closed once every file is queued: the workers then drain and end
                    async with anyio.create_task_group() as feeders:
                        run.feeders = feeders
                        for root in candidates.values():  # first: their requests go out before the listing's next page
                            feeders.start_soon(run.overlay, root, deadline)
                        feeders.start_soon(run.list, deadline)
                        feeders.start_soon(run.from_points, deadline)
                    for name in commits_begun_meanwhile(candidates, run.listing.bundles, run.bundles_read):
                        raise RestoreError(
                            f"a snapshot commit of {candidates[name].path} began in {store.description} while "
                            "it was being restored (an older sidecar is still writing); restore again")
                    stored = run.stored()
                    for name in run.older:  # held by its record, older than the store: merged
                        disk[name] = replace(disk[name], held=False, older=True)
                    result.decisions = decide_roots(disk, stored, mode)
                    for root, d in zip(roots, result.decisions, strict=True):
                        log.info("restore_decision", root=root.path, restore=d.restore, reason=d.reason,
                                 stored=stored[root.name])
            flushing.cancel_scope.cancel()  # every download ended (a flush under way completes)
    except BaseExceptionGroup as eg:  # report the first real cause, one line
        for exc in leaves(eg):
            if isinstance(exc, StoreError) and run.started:
                # Files are already in place: the roots hold a fragment now, which must not
                # pass for a restore that found the store unreachable (SIDECAR_RESTORE_OPTIONAL
                # starts the host then). Their markers stay: the next start restores them again.
                raise RestoreError(f"cut short after {run.progress.files} files: {exc}") from None
            if isinstance(exc, (RestoreError, StoreError)):
                raise exc from None
        raise
    finally:
        run.dirs.close()
    run.progress.finish()
    # the roots recorded now hold the namespace's state as stored: of its newest generation
    result.generation = max(marker_generation, stored_generation(run.listing.own_max_version))
    lineage = replace(lineage, generation=result.generation)
    await _finish(plan_finish(result.decisions, disk, candidates, set(run.started)),
                  {r.name: r for r in roots}, lineage, result)
    result.files, result.bytes = run.progress.files, run.progress.bytes
    result.seconds = time.monotonic() - t0
    _report(result, merged=bool(plan.merging) or bool(run.older and mode == "auto"))
    return run.listing, result


class ForeignDisk(Exception):
    """A root holds files another store or namespace put there (its lineage record names them):
    never restored into, never mirrored into this namespace (one line: both namespaces, the fix)."""


async def check_foreign(roots: list[Root], lineage: Lineage, ignore: IgnoreRules | None) -> None:
    """Raise :class:`ForeignDisk` for the first root that holds files and a record naming another
    store or namespace than ``lineage``'s (:func:`~sidecar.restoreplan.foreign`). Reads the disk only:
    before the store is reached, so an unreachable store (``SIDECAR_RESTORE_OPTIONAL``) lets none by."""
    for root in roots:
        record = await anyio.to_thread.run_sync(read_lineage, root)
        if record is not None and foreign(record, lineage) \
                and await anyio.to_thread.run_sync(has_regular_files, root.path, ignore):
            raise ForeignDisk(foreign_refusal(root.path, record, lineage, log.printable))


async def _read_disk(root: Root, lineage: Lineage, ignore: IgnoreRules | None) -> Disk:
    """What the disk says of ``root`` before the restore (see :class:`~sidecar.restoreplan.Disk`);
    ``lineage`` carries the marker's generation."""
    record = await anyio.to_thread.run_sync(read_lineage, root)
    _warn_other_lineage(root, lineage, record)
    held = holds(record, lineage, lineage.generation or 0)
    return Disk(has_files=await anyio.to_thread.run_sync(has_regular_files, root.path, ignore),
                cut_short=restore_cut_short(root), held=held,
                generation=record.generation if held and record is not None else None)


def _warn_other_lineage(root: Root, lineage: Lineage, recorded: Lineage | None) -> None:
    """Say so when ``root`` records another store or namespace (and holds no files:
    :func:`check_foreign` refused those): it is filled from the store, never silently."""
    if recorded is not None and foreign(recorded, lineage):
        log.warning("lineage_other", root=root.path, recorded_store=recorded.store,
                    recorded_namespace=recorded.namespace or "-", store=lineage.store,
                    namespace=lineage.namespace or "-",
                    detail="this disk was filled or mirrored by another store or namespace: it is not the truth "
                           "here; it holds no files, and is filled from the store")


async def _finish(finish: Finish, by_name: dict[str, Root], lineage: Lineage, result: RestoreResult) -> None:
    """Apply :class:`~sidecar.restoreplan.Finish`: flush the filled roots, then record them, then
    remove their markers; remove the markers of cut-short roots left empty; record the rest."""
    for name in finish.filled:
        root = by_name[name]
        await anyio.to_thread.run_sync(syncfs, root.path)
        # every file is in place and flushed: recorded as this namespace's, then the marker goes
        await record_lineage(root, lineage, result)
        clear_restoring(root)
    for name in finish.cleared:
        clear_restoring(by_name[name])  # a cut-short restore, and nothing is stored any more: the disk is all there is
    for name in finish.recorded:
        await record_lineage(by_name[name], lineage, result)


def _report(result: RestoreResult, merged: bool) -> None:
    metrics.restore_finished(result.seconds)
    if result.generated_names:
        log.warning(
            "unresumable_checkpoints",
            detail=(
                f"stored checkpoints belong to workflows with generated names ({', '.join(sorted(result.generated_names)[:3])}); "
                "a WorkflowBuilder without name= gets a new random name in every process, so these can never be resumed. "
                "Fix: WorkflowBuilder(name=\"my-workflow\", ...)"
            ),
        )
    log.info("restore_done", files=result.files, from_points=result.from_points, bytes=result.bytes,
             seconds=round(result.seconds, 3),
             refused=len(result.refused), quarantined=len(result.quarantined), unverified=result.unverified,
             **({"replaced": len(result.replaced), "in_place": result.in_place} if merged else {}))


def lineage_of(store: Store, namespace: str, generation: int = 0) -> Lineage:
    """The lineage a root this sidecar fills or mirrors is recorded with: the store's description
    (secret-free, with its prefix), the namespace path and the generation of the state it holds."""
    return Lineage(store.description, namespace, generation)


async def record_lineage(root: Root, lineage: Lineage, result: RestoreResult | None = None) -> bool | None:
    """Record that ``lineage`` filled or mirrors ``root`` (see :func:`~sidecar.restorefs.write_lineage`):
    True. None when the root does not exist yet (added to ``result.unrecorded``: recorded before
    its first upload); False when the record cannot be written (logged: the root is then not the
    truth on the next start, and is merged, which loses nothing)."""
    try:
        await anyio.to_thread.run_sync(write_lineage, root, lineage)
        return True
    except FileNotFoundError:
        if result is not None:
            result.unrecorded.add(root.name)
        return None
    except OSError as e:
        log.warning("lineage_unrecorded", root=root.path, error=e.strerror or type(e).__name__,
                    detail="the next start takes this root for a new disk and merges it from the store")
        return False

