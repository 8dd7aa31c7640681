"""The upload queue: turns path hints into durable store operations, in a safe order.

Hints (``mark_paths``) are resolved by :class:`~sidecar.hints.Hints` into upload and delete
intents, recorded in a :class:`~sidecar.queue.PendingSet`, which coalesces per path and enforces
the delete barrier. ``concurrency`` workers take ready operations; each upload re-reads the file at
handling time, so what lands is always the newest complete version. A snapshot root has its own
pending set and one worker, which hands each batch to the :class:`~sidecar.snapshot.Committer`.
Every write goes through the :class:`~sidecar.writer.Writer` (the fence's claim, a proof right
before each write, the version); a fenced worker parks for good, its work left pending. Failed operations are
retried (:class:`~sidecar.retry.Retry`: backoff with jitter) for as long as the process runs; the
pending set keeps at most one entry per path meanwhile.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus

from sidecar import log, metrics
from sidecar.fence import Fenced
from sidecar.hints import Hints
from sidecar.known import StoreState
from sidecar.localfs import (
    SMALL_BODY,
    ByteBudget,
    FileSource,
    TooLarge,
    Unstable,
    Vanished,
    body_bytes,
    read_for_upload,
    release_free_memory,
)
from sidecar.paths import IgnoreRules, Root, split_key
from sidecar.queue import DELETE, UPLOAD, Kind, Op, PendingSet
from sidecar.retry import Retry, StoreHealth
from sidecar.snapshot import Committer
from sidecar.store.base import ObjectMeta, StoreError
from sidecar.writer import Writer

#: Store operations after which going idle also hands freed heap memory back to the system.
TRIM_AFTER_OPS = 256
#: Seconds a delete waits, after it was seen, before its root is checked and the delete sent: the
#: deletions of an ``rm -rf`` of the whole root come before the root itself goes, and a root that
#: goes as a whole deletes nothing (a burst of deletes waits this once, not once each).
DELETE_SETTLE = 0.1
#: Failures of a per-file operation that are neither the store's nor an unstable file's after which
#: it is given up for now (the next reconcile tries again).
INTERNAL_GIVE_UP = 5


class Uploader:
    def __init__(
        self,
        writer: Writer,
        roots: list[Root],
        ignore: IgnoreRules,
        known: StoreState | None = None,
        *,
        concurrency: int = 16,
        max_file_size: int = 256 * 1024 * 1024,
        snapshot_roots: set[str] = frozenset(),  # type: ignore[assignment]
        on_degraded: Callable[[float | None], None] | None = None,
        intact: Callable[[Root], bool] = lambda root: True,
    ) -> None:
        #: every write goes through it (claim, proof, version); it tells when we are fenced
        self.writer = writer
        self.roots = roots
        self.roots_by_name = {r.name: r for r in roots}
        self.concurrency = concurrency
        self.max_file_size = max_file_size
        self.pending = PendingSet()
        #: roots committed as crash-consistent snapshots (see sidecar.snapshot), one set each
        self.snapshots: dict[str, PendingSet] = {name: PendingSet() for name in snapshot_roots}
        #: what the store is known to hold: its objects, their directories, the skipped files and
        #: the outstanding bundles (shared with the daemon's reconcile)
        self.known = StoreState() if known is None else known
        #: whether store operations are failing; tells ``on_degraded`` (the daemon's Health)
        self.store_health = StoreHealth(on_degraded)
        #: for the metrics and the shutdown summary line
        self.totals = metrics.Totals()
        #: whether a root is the directory being mirrored: a delete is sent only while it is (a root
        #: removed or replaced as a whole deletes nothing; the daemon's next scan decides)
        self.intact = intact
        self.hints = Hints(roots, ignore, self.known, self, intact)
        self.committer = Committer(writer, roots, ignore, self.known, max_file_size=max_file_size,
                                   totals=self.totals, intact=intact, on_skip=self.hints.skip)
        self._dirty_since: dict[str, float] = {}
        #: when each queued delete was last seen (monotonic), for :data:`DELETE_SETTLE`
        self._delete_seen: dict[str, float] = {}
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._ops_since_trim = 0
        #: the file bodies the uploads hold in memory (see localfs.BODY_BUDGET)
        self.bodies = ByteBudget()

    # -- producers -------------------------------------------------------------------------
    def _notify(self) -> None:
        self._wake.set()
        self._wake = anyio.Event()
        metrics.PENDING.set(self.pending_count())
        if self.idle():
            self._idle.set()
        elif self._idle.is_set():
            self._idle = anyio.Event()

    def _set_for(self, key: str) -> PendingSet:
        ps = self.snapshots.get(key.split("/", 1)[0])
        return self.pending if ps is None else ps  # (an empty PendingSet is falsy)

    def mark(self, key: str, kind: Kind) -> None:
        """Queue ``kind`` for ``key`` (the newest intent for a key wins)."""
        if kind == UPLOAD:
            self._dirty_since.setdefault(key, time.monotonic())
            if not self.known.has_dir(key.rpartition("/")[0]):
                self.known.note_dirs((key,))
        else:
            self._delete_seen[key] = time.monotonic()
        self._set_for(key).mark(key, kind)

    def mark_keys(self, upload: list[str] = (), delete: list[str] = ()) -> None:  # type: ignore[assignment]
        for k in upload:
            self.mark(k, UPLOAD)
        for k in delete:
            self.mark(k, DELETE)
        self._notify()

    def mark_paths(self, paths: list[str]) -> None:
        """Record hints about absolute paths (from the watcher): see :meth:`Hints.mark_paths`."""
        self.hints.mark_paths(paths)
        self._notify()

    # -- state -----------------------------------------------------------------------------
    @property
    def fenced(self) -> anyio.Event:
        """Set once a newer sidecar owns the namespace (the writer's)."""
        return self.writer.fenced

    def _sets(self) -> list[PendingSet]:
        return [self.pending, *self.snapshots.values()]

    def is_pending(self, key: str) -> bool:
        """Whether an operation on ``key`` is pending or running."""
        return any(key in ps.pending or key in ps.inflight for ps in self._sets())

    def idle(self) -> bool:
        return all(ps.idle() for ps in self._sets())

    def pending_keys(self) -> set[str]:
        return set().union(*(ps.keys() for ps in self._sets()))

    def pending_count(self) -> int:
        return sum(ps.path_count() for ps in self._sets())

    async def wait_idle(self) -> None:
        while not self.idle():
            await self._idle.wait()

    # -- workers ---------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._claim)
            for _ in range(self.concurrency):
                tg.start_soon(self._worker)
            for name in self.snapshots:
                tg.start_soon(self._snapshot_worker, self.roots_by_name[name])
            task_status.started()

    async def _worker(self) -> None:
        while True:
            op = self.pending.take()
            if op is None:
                await self._wake.wait()
                continue
            try:
                await self._handle(op)
            finally:
                self._notify()  # wakes workers waiting on a barrier this op may have opened

    async def _claim(self) -> None:
        """Claim the store (see fence.py); every write waits for this. While the store refuses or
        fails, the claim is retried forever and counted as a failing write (degraded, logged):
        a read-only credential shows up there, not as silence."""
        retry = self.store_health.retry(op="claim")
        while True:
            try:
                await self.writer.claim()
            except Fenced:
                return
            except StoreError as e:
                await retry.failed(e)
            else:
                self._succeeded(retry)
                return

    async def drop_stale_bundles(self, keep: set[str]) -> None:
        """Delete the bundles cut-short snapshot commits left, except for roots in ``keep``: see
        :meth:`Committer.drop_stale_bundles`. Fenced: nothing is deleted."""
        with contextlib.suppress(Fenced):
            await self.committer.drop_stale_bundles(set(self.snapshots), keep, self.pending_keys)

    async def _handle(self, op: Op) -> None:
        started = self._dirty_since.pop(op.key, None) if op.kind == UPLOAD else None
        seen = self._delete_seen.pop(op.key, None)
        retry = self.store_health.retry(path=op.key, op=op.kind)
        while True:
            try:
                await self.writer.ready()  # before the file is read: the claim's wait holds no memory
                if op.kind == UPLOAD:
                    await self._upload(op, started)
                elif not await self._root_settled(op.key, seen):
                    # its root went (or was replaced) since the delete was queued: not the host's
                    # delete of one file; dropped, the scan the watcher runs for the root decides
                    log.debug("delete_held", path=op.key, detail="its root is gone or was replaced")
                else:
                    await self.writer.delete(op.key)
                    self.known.deleted(op.key)
                    self.totals.deleted()
                    log.debug("deleted", path=op.key)
                self.pending.done(op)
                self._succeeded(retry)
                return
            except Fenced:  # nothing more is written: the op stays in flight, reported as pending
                await anyio.sleep_forever()
            except Exception as e:  # a bug or an unexpected OS error included: never kill the daemon
                if not await retry.failed(e, give_up=INTERNAL_GIVE_UP):
                    self.pending.done(op)  # given up for now; the next reconcile tries again
                    return

    async def _root_settled(self, key: str, seen: float | None) -> bool:
        """Whether ``key``'s root is still the directory being mirrored :data:`DELETE_SETTLE` after
        its delete was seen (a delete is never sent for a root that went as a whole)."""
        if seen is not None:
            await anyio.sleep(max(0.0, seen + DELETE_SETTLE - time.monotonic()))
        root = self.roots_by_name.get(key.partition("/")[0])
        return root is None or await anyio.to_thread.run_sync(self.intact, root)

    def _succeeded(self, retry: Retry) -> None:
        retry.succeeded()
        self._ops_since_trim += 1
        if self.idle():
            metrics.LAST_SYNC.set(time.time())
            if self._ops_since_trim >= TRIM_AFTER_OPS:
                # A burst (the first reconcile, a restore of many files) leaves freed heap pages
                # behind; give them back now that the work is done.
                self._ops_since_trim = 0
                release_free_memory()

    # -- snapshot roots --------------------------------------------------------------------
    async def _snapshot_worker(self, root: Root) -> None:
        ps = self.snapshots[root.name]
        retry = self.store_health.retry("snapshot_failed", {"path": root.name}, path=root.name, op="snapshot")
        while True:
            ops = ps.take_all()
            if not ops:
                await self._wake.wait()
                continue
            started = [t for t in (self._dirty_since.pop(op.key, None) for op in ops) if t is not None]
            try:
                await self.writer.ready()
                committed = await self.committer.commit(root, [op.key for op in ops])
            except Fenced:  # nothing more is written: the batch stays in flight, reported as pending
                await anyio.sleep_forever()
            except Exception as e:  # never kill the daemon; the batch stays pending
                for op in ops:
                    ps.retry(op)
                self._notify()
                await retry.failed(e)
                continue
            if not committed:  # the disk changed while being read: read again after its next write
                for op in ops:
                    ps.retry(op)
                await retry.disk_moved(0.005)
                continue
            for op in ops:
                ps.done(op)
            now = time.monotonic()
            for t in started:
                metrics.LATENCY.observe(now - t)
            self._succeeded(retry)
            self._notify()

    # -- per-file uploads ------------------------------------------------------------------
    async def _upload(self, op: Op, started: float | None) -> None:
        root, parts = split_key(op.key, self.roots_by_name)
        got = await self._read(op, root, parts, SMALL_BODY)
        if isinstance(got, int):  # larger than a checkpoint: read once its bytes fit in the budget
            async with self.bodies.hold(body_bytes(got)):
                got = await self._read(op, root, parts, 2**63)
                assert not isinstance(got, int)
                if got is not None:
                    await self._store(op, root, parts, *got, started)
        elif got is not None:
            await self._store(op, root, parts, *got, started)

    async def _read(self, op: Op, root: Root, parts: list[str],
                    read_max: int) -> "tuple[bytes | FileSource, ObjectMeta] | int | None":
        """:func:`read_for_upload`; None when there is nothing to upload (the file is gone,
        too large or unreadable: handled here)."""
        try:
            return await anyio.to_thread.run_sync(read_for_upload, root, parts, self.max_file_size, read_max)
        except Vanished:
            # gone since the hint: mirror the delete, behind the barrier like any other (unless the
            # whole root went: then the worker holds it back)
            if op.key in self.known:
                self.mark(op.key, DELETE)
        except TooLarge as e:
            self.hints.skip(op.key, root, parts, "too_large", str(e))
        except OSError as e:
            self.hints.skip(op.key, root, parts, "unreadable", e.strerror or type(e).__name__)
        return None

    async def _store(self, op: Op, root: Root, parts: list[str], data: bytes | FileSource, meta: ObjectMeta,
                     started: float | None) -> None:
        self.known.unskip(op.key)
        known = self.known.get(op.key)
        if known is None or not known.same_as(meta):
            try:
                info = await self.writer.put(op.key, data, meta, expected=known)
            except (Unstable, Vanished):  # a streamed file changed while it was sent: nothing was stored
                self.mark(op.key, UPLOAD)
                return
            self.known.stored(op.key, info)
            if self.writer.newer(info):
                # A newer owner of the namespace stored a later version (the fence stops this
                # sidecar at its next proof): this older content is not stored. Never silently.
                self.hints.skip(op.key, root, parts, "store_newer",
                                "a newer sidecar of this namespace stored a later version of this file")
            else:
                self.totals.uploaded(meta.size)
                log.debug("uploaded", path=op.key, bytes=meta.size)
        if started is not None:
            metrics.LATENCY.observe(time.monotonic() - started)
