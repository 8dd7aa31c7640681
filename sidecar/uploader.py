"""The upload queue: turns path hints into durable store operations, in a safe order.

Hints (``mark_path``) are resolved against the disk when they arrive (file, directory, gone) and
recorded in a :class:`~sidecar.queue.PendingSet`, which coalesces per path and enforces the delete
barrier. ``concurrency`` workers take ready operations; each upload re-reads the file at handling
time, so what lands is always the newest complete version. Store failures are retried with
exponential backoff and jitter for as long as the process runs; the pending set keeps at most one
entry per path meanwhile.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import replace
from typing import Callable

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus

from sidecar import log, metrics
from sidecar.fence import Fence, Fenced
from sidecar.known import StoreState
from sidecar.localfs import (
    TooLarge,
    Unstable,
    Vanished,
    absent,
    below_root_without_links,
    read_for_upload,
    read_stable,
    release_free_memory,
    scan_root,
)
from sidecar.paths import IgnoreRules, Root, UnsafeKey, locate, make_key, split_key
from sidecar.queue import DELETE, UPLOAD, Op, PendingSet
from sidecar.retry import backoff
from sidecar.snapshot import BUNDLE_DIR, Change, bundle_key, encode_bundle
from sidecar.store.base import ObjectMeta, Store, StoreError, StoreFull, TransientStoreError

#: Store operations after which going idle also hands freed heap memory back to the system.
TRIM_AFTER_OPS = 256
#: Longest wait between retries while the store is full (StoreFull): space can come back any time.
FULL_RETRY_MAX = 2.0


class Uploader:
    def __init__(
        self,
        store: Store,
        roots: list[Root],
        ignore: IgnoreRules,
        known: StoreState | None = None,
        *,
        fence: Fence | None = None,
        concurrency: int = 16,
        max_file_size: int = 256 * 1024 * 1024,
        snapshot_roots: set[str] = frozenset(),  # type: ignore[assignment]
        on_degraded: Callable[[float | None], None] | None = None,
    ) -> None:
        self.store = store
        #: told the monotonic time the store began failing, and None once it works again
        self.on_degraded = on_degraded
        self.roots = roots
        self.roots_by_name = {r.name: r for r in roots}
        self.ignore = ignore
        self.concurrency = concurrency
        self.max_file_size = max_file_size
        self.pending = PendingSet()
        #: roots committed as crash-consistent snapshots (see sidecar.snapshot), one set each
        self.snapshots: dict[str, PendingSet] = {name: PendingSet() for name in snapshot_roots}
        #: per root: a commit's bundle put..delete and the start-up cleanup's delete never interleave
        self._bundle_locks: dict[str, anyio.Lock] = {}
        #: proves ownership of the store prefix before writes (sync/run; None: no claim)
        self.fence = fence
        self.fenced = anyio.Event()
        #: what the store is known to hold: its objects, their directories, the skipped files and
        #: the outstanding bundles (shared with the daemon's reconcile)
        self.known = StoreState() if known is None else known
        self._dirty_since: dict[str, float] = {}
        #: for the shutdown summary line
        self.totals = {"uploaded": 0, "bytes": 0, "deleted": 0}
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._warned: set[tuple[str, str]] = set()
        self._ops_since_trim = 0
        self.failing_since: float | None = None

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

    def mark(self, key: str, kind: str) -> None:
        if kind == UPLOAD:
            self._dirty_since.setdefault(key, time.monotonic())
            if not self.known.has_dir(key.rpartition("/")[0]):
                self.known.note_dirs((key,))
        self._set_for(key).mark(key, kind)  # type: ignore[arg-type]

    def mark_keys(self, upload: list[str] = (), delete: list[str] = ()) -> None:  # type: ignore[assignment]
        for k in upload:
            self.mark(k, UPLOAD)
        for k in delete:
            self.mark(k, DELETE)
        self._notify()

    def mark_paths(self, paths: list[str]) -> None:
        """Record hints about absolute paths (from the watcher).

        A batch comes in no particular order (watchfiles hands over a set), so its deletions are
        queued after all of its uploads: "write B, then delete A" (or a renamed directory) must
        never have A gone from the store before B is in it."""
        gone: list[str] = []
        for path in paths:
            self._mark_path(path, gone)
        for key in gone:
            self._mark_gone(key)
        self._notify()

    def _mark_path(self, path: str, gone: list[str], resolved: bool = False) -> None:
        found = locate(path, self.roots)
        if found is None:
            return
        root, rel = found
        if rel and not resolved and not below_root_without_links(root, rel):
            # Reached through a symlinked directory. inotify watches inodes, so a symlink looping
            # back into a root makes events of real files arrive under the link's path: map the
            # real location back, and drop whatever really lies outside the roots.
            real = os.path.realpath(os.path.dirname(path))
            for r in self.roots:
                real_root = os.path.realpath(r.path)
                if real == real_root or real.startswith(real_root + "/"):
                    self._mark_path(os.path.join(r.path, os.path.relpath(real, real_root),
                                                 os.path.basename(path)), gone, resolved=True)
            return
        if not rel:
            return  # the root itself: handled by the watcher's root tracking
        if self.ignore.ignored(rel):
            return  # a writer's temp file, present or already renamed away
        try:
            key = make_key(root, rel)
        except UnsafeKey:
            self._warn_once("unmirrorable_name", rel)
            return
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            gone.append(key)
            return
        except OSError:
            return
        if stat.S_ISREG(st.st_mode):
            self.mark(key, UPLOAD)
        elif stat.S_ISDIR(st.st_mode):
            # a directory moved in brings files that produce no events of their own
            files, _ = scan_root(Root(key, path), self.ignore)  # keys come out as key/...
            for k in files:
                self.mark(k, UPLOAD)
        else:  # a symlink or special file replaced what was there: never mirrored
            if stat.S_ISLNK(st.st_mode):
                self._warn_once("symlink_skipped", key)
            gone.append(key)

    def _is_pending(self, key: str) -> bool:
        return any(key in ps.pending or key in ps.inflight for ps in self._sets())

    def _mark_gone(self, key: str) -> None:
        if key in self.known or self._is_pending(key):
            self.mark(key, DELETE)
        elif self.known.has_dir(key):  # a directory deleted or moved away: everything below it
            prefix = key + "/"
            for k in self.known.keys_below(prefix) + [
                k for k in self.pending_keys() if k.startswith(prefix)
            ]:
                self.mark(k, DELETE)

    def _skip(self, key: str, root: Root, parts: list[str], reason: str, detail: str) -> None:
        """Count and log a file that is not mirrored, once per version of it."""
        try:
            st = os.lstat(os.path.join(root.path, *parts))
            sig: tuple[int, int, int] | None = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        except OSError:
            sig = None
        if sig is not None and not self.known.skip(key, sig):
            return  # the same file as last time: counted and logged already
        metrics.SKIPPED.labels(reason).inc()
        event = {"too_large": "file_too_large", "store_newer": "file_older_than_stored"}.get(reason, "file_unreadable")
        self._warn_once(event, f"{key} ({detail})")

    def _warn_once(self, event: str, what: str) -> None:
        if (event, what) not in self._warned:
            self._warned.add((event, what))
            log.warning(event, path=what)

    # -- state -----------------------------------------------------------------------------
    def _sets(self) -> list[PendingSet]:
        return [self.pending, *self.snapshots.values()]

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
            if self.fence is not None:
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
        attempt = 0
        while True:
            attempt += 1
            try:
                await self.fence.claim()  # type: ignore[union-attr]  # run() requires a fence
            except Fenced:
                self._mark_fenced()
                return
            except StoreError as e:
                await self._store_failed(e, attempt, op="claim")
            else:
                self._succeeded()
                return

    async def drop_stale_bundles(self, keep: set[str]) -> None:
        """Delete the bundles that cut-short snapshot commits left for roots with nothing left to
        commit (their disk already matches the per-file objects), except for roots in ``keep``
        (whose disk is not the truth). A delete is a write: it waits for the claim."""
        await self._guard()
        if self.snapshots:
            # Listed again now that the claim's wait is over: a predecessor fenced in the middle of
            # a commit may have left its bundle after our start-up listing, and from now on none of
            # its writes can land. Left in place, a later restore would lay it over our files.
            try:
                async for info in self.store.list(BUNDLE_DIR + "/"):
                    name = info.key[len(BUNDLE_DIR) + 1 :]
                    if name in self.snapshots:
                        self.known.add_bundle(name)
            except StoreError as e:
                log.warning("bundle_cleanup_failed", root="-", error=str(e))
        for name in sorted(self.known.bundles() - keep):
            async with self._bundle_lock(name):
                # decided under the lock: a commit of this root may have replaced the bundle, or
                # have changes to commit, since the loop began
                if not self.known.has_bundle(name) or any(k.split("/", 1)[0] == name for k in self.pending_keys()):
                    continue
                try:
                    await self.store.delete(bundle_key(name))
                    self.known.discard_bundle(name)
                except StoreError as e:
                    log.warning("bundle_cleanup_failed", root=name, error=str(e))

    def _bundle_lock(self, root_name: str) -> anyio.Lock:
        return self._bundle_locks.setdefault(root_name, anyio.Lock())

    async def _guard(self) -> None:
        """Before any write: wait for and prove store ownership; park for good when fenced."""
        if self.fence is None:
            return
        try:
            await self.fence.before_write()
        except Fenced:
            self._mark_fenced()
            await anyio.sleep_forever()

    def _version(self) -> int:
        """The version of the next write (see ``Fence.next_version``; 0 without a fence)."""
        return self.fence.next_version() if self.fence is not None else 0

    def _mark_fenced(self) -> None:
        """A newer sidecar owns the store prefix (the fence has logged why): no more writes."""
        self.fenced.set()
        metrics.FENCED.set(1)

    async def _handle(self, op: Op) -> None:
        started = self._dirty_since.pop(op.key, None) if op.kind == UPLOAD else None
        attempt = 0
        while True:
            attempt += 1
            try:
                await self._guard()
                if op.kind == UPLOAD:
                    await self._upload(op, started)
                else:
                    await self.store.delete(op.key)
                    self.known.deleted(op.key)
                    self._count_delete()
                    log.debug("deleted", path=op.key)
                self.pending.done(op)
                self._succeeded()
                return
            except StoreError as e:
                await self._store_failed(e, attempt, path=op.key, op=op.kind)
            except Unstable:
                metrics.FAILURES.labels("unstable").inc()
                await anyio.sleep(backoff(attempt))
            except Exception as e:  # a bug or an unexpected OS error: never kill the daemon
                metrics.FAILURES.labels("internal").inc()
                log.error("operation_failed", exc=e, path=op.key, op=op.kind, attempt=attempt)
                if attempt >= 5:
                    self.pending.done(op)  # given up for now; the next reconcile tries again
                    return
                await anyio.sleep(backoff(attempt))

    def _count_upload(self, size: int) -> None:
        self.totals["uploaded"] += 1
        self.totals["bytes"] += size
        metrics.UPLOADS.inc()
        metrics.UPLOAD_BYTES.inc(size)

    def _count_delete(self) -> None:
        self.totals["deleted"] += 1
        metrics.DELETES.inc()

    def _succeeded(self) -> None:
        if self.failing_since is not None:
            log.info("store_recovered", seconds=round(time.monotonic() - self.failing_since, 1))
            self.failing_since = None
            metrics.DEGRADED.set(0)
            if self.on_degraded is not None:
                self.on_degraded(None)
        self._ops_since_trim += 1
        if self.idle():
            metrics.LAST_SYNC.set(time.time())
            if self._ops_since_trim >= TRIM_AFTER_OPS:
                # A burst (the first reconcile, a restore of many files) leaves freed heap pages
                # behind; give them back now that the work is done.
                self._ops_since_trim = 0
                release_free_memory()

    async def _store_failed(self, e: StoreError, attempt: int, **fields) -> None:
        """Count, log and back off; the caller then tries again (forever: nothing is dropped)."""
        transient = isinstance(e, TransientStoreError)
        metrics.FAILURES.labels("transient" if transient else "store").inc()
        metrics.RETRIES.inc()
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            metrics.DEGRADED.set(1)
            if self.on_degraded is not None:
                self.on_degraded(self.failing_since)
        (log.warning if transient else log.error)("store_retry", attempt=attempt, error=str(e), **fields)
        if isinstance(e, StoreFull):  # cheap to retry, and space can come back at any moment
            await anyio.sleep(min(backoff(attempt), FULL_RETRY_MAX))
        else:
            await anyio.sleep(backoff(attempt) * (1 if transient else 4))

    # -- snapshot roots --------------------------------------------------------------------
    async def _snapshot_worker(self, root: Root) -> None:
        ps = self.snapshots[root.name]
        attempt = 0
        while True:
            ops = ps.take_all()
            if not ops:
                await self._wake.wait()
                continue
            started = [t for t in (self._dirty_since.pop(op.key, None) for op in ops) if t is not None]
            try:
                await self._guard()
                committed = await self._commit_snapshot(root, [op.key for op in ops])
            except StoreError as e:
                attempt += 1
                for op in ops:
                    ps.retry(op)
                self._notify()
                await self._store_failed(e, attempt, path=root.name, op="snapshot")
                continue
            except Exception as e:  # never kill the daemon; the batch stays pending
                attempt += 1
                for op in ops:
                    ps.retry(op)
                metrics.FAILURES.labels("internal").inc()
                log.error("snapshot_failed", exc=e, path=root.name, attempt=attempt)
                await anyio.sleep(backoff(attempt))
                continue
            if not committed:  # the disk changed while being read: read again after its next write
                for op in ops:
                    ps.retry(op)
                metrics.FAILURES.labels("unstable").inc()
                await anyio.sleep(0.005)
                continue
            attempt = 0
            for op in ops:
                ps.done(op)
            now = time.monotonic()
            for t in started:
                metrics.LATENCY.observe(now - t)
            self._succeeded()
            self._notify()

    async def _commit_snapshot(self, root: Root, keys: list[str]) -> bool:
        """Commit ``keys`` of ``root`` as one consistent state; False when the disk moved."""

        def snapshot() -> list[Change] | None:
            before, _ = scan_root(root, self.ignore)
            changes = []
            for key in sorted(keys):
                if key in before:
                    _, parts = split_key(key, self.roots_by_name)
                    try:
                        data, meta = read_stable(root, parts, self.max_file_size)
                    except (Vanished, Unstable):
                        return None
                    changes.append(Change(key, data, meta))
                elif key in self.known and absent(root, key.split("/", 1)[1]):
                    changes.append(Change(key, None, None))  # gone for sure: not merely unreadable
            after, _ = scan_root(root, self.ignore)
            return changes if after == before else None

        changes = await anyio.to_thread.run_sync(snapshot)
        if changes is None:
            return False
        changes = [c for c in changes if c.data is None or not (
            (info := self.known.get(c.key)) is not None and info.same_as(c.written))]
        async with self._bundle_lock(root.name):
            await self._apply_changes(root, changes)
        log.debug("snapshot_committed", root=root.name, changes=len(changes))
        return True

    async def _apply_changes(self, root: Root, changes: list[Change]) -> None:
        # Every write proves ownership (free within the fence's window): a large commit can outlast
        # one proof, and a newer owner's objects must never see our writes after it.
        if len(changes) > 1 or (changes and self.known.has_bundle(root.name)):
            blob = encode_bundle(root.name, changes)
            await self._guard()
            await self.store.put(bundle_key(root.name), blob,
                                 ObjectMeta.of(blob, time.time_ns(), 0o600, version=self._version()))
            self.known.add_bundle(root.name)
        for c in changes:  # the bundle makes the batch atomic; order within it does not matter
            await self._guard()
            if c.data is None:
                await self.store.delete(c.key)
                self.known.deleted(c.key)
                self._count_delete()
            else:
                self.known.stored(c.key, await self.store.put(c.key, c.data, replace(c.written, version=self._version())))
                self._count_upload(len(c.data))
        if self.known.has_bundle(root.name):
            await self._guard()
            await self.store.delete(bundle_key(root.name))
            self.known.discard_bundle(root.name)

    async def _upload(self, op: Op, started: float | None) -> None:
        root, parts = split_key(op.key, self.roots_by_name)
        try:
            data, meta = await anyio.to_thread.run_sync(read_for_upload, root, parts, self.max_file_size)
        except Vanished:
            # gone since the hint: mirror the delete, behind the barrier like any other
            if op.key in self.known:
                self.mark(op.key, DELETE)
            return
        except TooLarge as e:
            self._skip(op.key, root, parts, "too_large", str(e))
            return
        except OSError as e:
            self._skip(op.key, root, parts, "unreadable", e.strerror or type(e).__name__)
            return
        self.known.unskip(op.key)
        known = self.known.get(op.key)
        if known is None or not known.same_as(meta):
            meta = replace(meta, version=self._version())
            try:
                info = await self.store.put(op.key, data, meta)
            except (Unstable, Vanished):  # a streamed file changed while it was sent: nothing was stored
                self.mark(op.key, UPLOAD)
                return
            self.known.stored(op.key, info)
            if info.version > meta.version:
                # A newer owner of the namespace stored a later version (the fence stops this
                # sidecar at its next proof): this older content is not stored. Never silently.
                self._skip(op.key, root, parts, "store_newer",
                           "a newer sidecar of this namespace stored a later version of this file")
            else:
                self._count_upload(meta.size)
                log.debug("uploaded", path=op.key, bytes=meta.size)
        if started is not None:
            metrics.LATENCY.observe(time.monotonic() - started)
