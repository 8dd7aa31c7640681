"""The sync daemon: made, then run: restore, then watch + upload + reconcile until told to stop, then drain.

Its methods, in the order they run::

    prepare():  store.open → restore.latest.restore (downloads while the LIST streams in) → Startup
    build():    from the Startup, in order: fence + writer, take-over check, uploader, point writer
    serve():    watcher.watch ──paths──▶ Uploader.mark_paths ──▶ PendingSet ──▶ workers ──▶ store
                reconcile(): local rescan vs known store state (no LIST); reconcile_listed(): a full LIST, rarely
    drain():    keep watching; wait until nothing is pending (bounded), rescan once, wait again

What each root is known to be is the ledger's (:class:`sidecar.ledger.RootLedger`).
"""

from __future__ import annotations

import enum
import os
import stat
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus

from sidecar import log, metrics
from sidecar.config import Settings
from sidecar.fence import OWNER_KEY, Taken, take_for_restore
from sidecar.health import Health, Phase, RestorePhase
from sidecar.known import StoreState
from sidecar.ledger import RootLedger
from sidecar.listing import Listing, list_store
from sidecar.localfs import Gaps, LocalStat, absent, below_root_without_links, root_identity, scan_root
from sidecar.paths import IgnoreRules, Root, is_within
from sidecar.plan import plan_reconcile_queue, plan_root_keep
from sidecar.restore.latest import RestoreResult, check_foreign, lineage_of, record_lineage, restore
from sidecar.restore.plan import holds
from sidecar.restorefs import lineage_recorded, read_lineage, restore_cut_short, write_lineage
from sidecar.retry import STARTUP_RETRY_SECONDS, reported_wait, retry_transient
from sidecar.store.base import Store, StoreError

if TYPE_CHECKING:
    from sidecar.points.writer import PointWriter
    from sidecar.takeovercheck import TakeoverCheck
    from sidecar.uploader import Uploader
    from sidecar.writer import Writer


@dataclass(frozen=True)
class Startup:
    """What start-up found and did, made by :meth:`Daemon.prepare`; serving builds its parts from
    it (:meth:`Daemon.build`). The default: no restore ran (or the store was unreachable)."""

    #: what the store is known to hold (the restore's listing, its objects handed over, not copied):
    #: the uploader, the committer and the reconciles share it
    known: StoreState = field(default_factory=StoreState)
    #: what this start's restore did (None: not run, or it found the store unreachable)
    restored: RestoreResult | None = None
    #: the store held nothing in this compute's namespace at start (None: not listed)
    namespace_empty: bool | None = None
    #: the highest version stored in the namespace at start, the fence claims above it (None: not
    #: listed, the fence lists at its claim)
    stored_max_version: int | None = None
    #: the owner marker's generation read before the restore, then the newest stored: a root's
    #: record must be no older for the disk to be held (see sidecar.restore.plan.holds)
    marker_generation: int = 0
    #: what reading the owner marker found and did (a released owner or a pending prune taken over)
    taken: Taken | None = None
    #: the roots the restore's listing held files or a bundle of (None: not listed)
    stored_roots: frozenset[str] | None = None


class Occasion(enum.Enum):
    """Why a reconcile runs: what it logs, and whether it classifies the roots (the first)."""

    INITIAL = "initial"  # the first, once the watch is in place
    CHANGE = "local"  # the periodic one, or roots the watcher reported
    FINAL = "final"  # the drain's last rescan
    FULL = "full"  # the periodic one against a fresh listing
    TAKEOVER = "takeover"  # the take-over check's, against its listing


class Daemon:
    """One sidecar's mirror. ``takes_over``: whether its start-up takes the namespace over from a
    released owner or a pending prune before its restore (sync, run; not the one-shot restore)."""

    writer: Writer
    takeover: TakeoverCheck
    uploader: Uploader
    points: PointWriter

    def __init__(self, settings: Settings, roots: list[Root], store: Store, *, takes_over: bool = True) -> None:
        self.settings = settings
        self.roots = roots
        self.store = store
        self.takes_over = takes_over
        self.ignore = settings.ignore_rules
        self.health = Health(namespace=settings.namespace.describe() if settings.namespace.path
                             or settings.namespace.identity else "")
        #: what start-up found (nothing until prepare() lists the store; the restore may be
        #: skipped, e.g. an unreachable store that is optional)
        self.startup = Startup()
        #: each root's state, and what of it is never deleted
        self.ledger = RootLedger(roots, self.health, self._ours)
        #: the lineage this sidecar's roots are recorded with (see sidecar.restore.finish.lineage_of): the
        #: marker's generation until our claim, ours after it
        self.lineage = lineage_of(store, settings.namespace.path)
        self._built = False
        self._version_unrecorded = log.Once()  # roots whose record's version could not be raised

    @property
    def known(self) -> StoreState:
        """What the store is known to hold (the start-up's, shared with the uploader)."""
        return self.startup.known

    @property
    def fenced(self) -> anyio.Event:
        """Set once a newer sidecar owns the namespace: nothing more is written (once serving)."""
        return self.writer.fenced

    @property
    def snapshot_roots(self) -> set[str]:
        """The roots committed as crash-consistent snapshots (see sidecar.snapshot)."""
        return {r.name for r in self.roots} if self.settings.snapshot_commits() else set()

    async def _ours(self, root: Root) -> bool:
        """Whether ``root``'s lineage record says it is this namespace's disk, held as it was last
        stored (see sidecar.restore.plan.holds)."""
        record = await anyio.to_thread.run_sync(read_lineage, root)
        # recorded under the lineage id read at start-up, or (once rewritten after our claim) ours
        found = self.startup.taken.lineage if self.startup.taken is not None else None
        return any(holds(record, replace(self.lineage, marker=marker), self.startup.marker_generation)
                   for marker in {found, self.lineage.marker})

    # -- phase 1: restore --------------------------------------------------------------------
    async def prepare(self) -> Startup:
        """Open the store, list it once and restore by the rule as the listing arrives. Reads
        only: :meth:`serve` claims the store (fencing off an older writer) before our first
        write, and the claim gates only our own writes (an older writer may still finish its
        current window meanwhile, see fence.py), so it delays neither the restore nor the host's
        start. Raises StoreError/RestoreError."""
        self.health.set(Phase.RESTORING, "restoring state from the store")
        self.health.restore_phase(RestorePhase.RUNNING)
        try:
            return await self._prepare()
        except BaseException:
            self.health.restore_phase(RestorePhase.FAILED)
            raise

    async def _prepare(self) -> Startup:
        deadline = time.monotonic() + STARTUP_RETRY_SECONDS
        ns = self.settings.namespace
        # another namespace's volume: refused before the store is reached (the disk alone says so)
        await check_foreign(self.roots, lineage_of(self.store, ns.path), self.ignore)
        await reported_wait(partial(retry_transient, self.store.open, "open", deadline),
                            "the store to answer (and, with a managed identity, a token)", store=self.store.description)
        log.info("store", store=self.store.description, namespace=ns.describe())
        # another session's namespace is never restored from (nor, later, claimed)
        taken = await retry_transient(partial(take_for_restore, self.store, ns.identity, ns.path,
                                              take=self.takes_over, store_url=self.settings.store),
                                      "read the owner marker", deadline)
        # kept when the restore fails: an optional restore's mirror claims with what was read
        self.startup = replace(self.startup, taken=taken, marker_generation=taken.generation)
        self.lineage = lineage_of(self.store, ns.path, taken.generation, marker=taken.lineage)
        listing, result = await restore(self.store, self.roots, mode=self.settings.restore,
                                        concurrency=self.settings.concurrency, deadline=deadline,
                                        on_corrupt=self.settings.restore_corrupt, max_file_size=self.settings.max_file_size,
                                        namespace=ns.path, ignore=self.ignore, marker_generation=taken.generation,
                                        marker_lineage=taken.lineage)
        self.ledger.due(result.unrecorded)
        # the newest generation stored counts as the marker's: a disk recorded older is not held
        self.startup = startup = Startup(
            known=StoreState.from_listing(listing, self.snapshot_roots), restored=result,
            namespace_empty=not listing.objects and not listing.bundles and not listing.unsafe,
            stored_max_version=listing.max_version, marker_generation=result.generation, taken=taken,
            stored_roots=frozenset({k.split("/", 1)[0] for k in listing.objects} | listing.bundles))
        self.lineage = lineage_of(self.store, ns.path, result.generation, listing.own_max_version, taken.lineage)
        if startup.namespace_empty and not taken.marker and not taken.pruned:
            log.info("namespace_empty", namespace=ns.describe(), detail="the store holds nothing in this namespace (a "
                     "new session, or one pruned after it ended): starting empty")
        self.health.restore_phase(RestorePhase.DONE)
        _warn_nested_namespaces(self.roots, listing)
        # what the restore refused or set aside: kept in the store, never taken for a deletion
        await self.ledger.keep(set(result.refused) | set(result.quarantined))
        await anyio.to_thread.run_sync(self._skip_merged_kept, result)
        return startup

    def _skip_merged_kept(self, result: RestoreResult) -> None:
        """In a merged root (a disk this namespace did not fill), a local file at the path of a key
        the restore refused or set aside is not the host's (an image's stale copy, say): that version
        is skipped, never uploaded over the stored object; once the host writes it, it is mirrored."""
        merged = {d.name for d in result.decisions if d.merge}
        by_name = {r.name: r for r in self.roots}
        for key in set(result.refused) | set(result.quarantined):
            name, _, rel = key.partition("/")
            if name not in merged or name not in by_name or not rel:
                continue
            try:
                st = os.lstat(os.path.join(by_name[name].path, rel))
            except (OSError, ValueError):
                continue
            if stat.S_ISREG(st.st_mode):
                self.known.skip(key, (st.st_size, st.st_mtime_ns, st.st_ctime_ns))

    # -- phase 2: mirror ---------------------------------------------------------------------
    def build(self) -> None:
        """Serving's parts, made from the start-up value in the order each needs the one before:
        the fence (it claims above the restore's listing) with the writer, the take-over check, the
        uploader (it claims through the writer), the point writer (it waits for both). Imported
        here: ``run`` starts its child before anything only mirroring needs is loaded. Once:
        :meth:`serve` builds them unless they were built before it (as a test may)."""
        from sidecar.fence import Fence
        from sidecar.points.plan import Retention
        from sidecar.points.writer import PointWriter
        from sidecar.takeovercheck import TakeoverCheck
        from sidecar.uploader import Uploader
        from sidecar.writer import Writer

        if self._built:
            return
        self._built = True
        s, start, ledger = self.settings, self.startup, self.ledger
        fence = Fence(self.store, s.fence_window, s.fence_margin, identity=s.namespace.identity,
                      namespace=s.namespace.path, on_wait=self.health.uploads_wait_until,
                      floor=start.stored_max_version, taken=start.taken, interval=s.heartbeat_interval,
                      store_url=s.store)
        self.writer = Writer(self.store, fence)
        self.writer.on_version = self._raise_recorded_version
        self.takeover = TakeoverCheck(self.writer, self._relist_after_takeover)
        self.uploader = Uploader(self.writer, self.roots, self.ignore, start.known, concurrency=s.concurrency,
                                 max_file_size=s.max_file_size, snapshot_roots=self.snapshot_roots,
                                 on_degraded=self.health.store_degraded, intact=ledger.root_intact)
        self.points = PointWriter(self.writer, self.roots, start.known, interval=s.restore_point_interval,
                                  full_interval=s.restore_point_full_interval,
                                  retention=Retention(s.restore_point_keep_all, s.restore_point_keep_hourly,
                                                      s.restore_point_keep_daily),
                                  idle=lambda: self.takeover.done.is_set() and self.uploader.idle(),
                                  wait_idle=self._wait_checked_idle,
                                  excluded=lambda: (ledger.kept_roots, set(ledger.kept_keys)))

    async def _wait_checked_idle(self) -> None:
        await self.takeover.done.wait()
        await self.uploader.wait_idle()

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Watch and mirror until cancelled. ``started()`` once the watch is in place and the
        first reconcile is planned (readiness)."""
        self.health.set(Phase.RECONCILING, "reconciling disk and store")
        from sidecar.watcher import watch  # imported here: ``run`` starts its child before this

        self.build()
        await self.ledger.begin()  # the directories mirroring begins with, before anything is watched
        async with anyio.create_task_group() as tg:
            await tg.start(self.uploader.run)
            tg.start_soon(self.writer.heartbeat, self.settings.heartbeat_interval)
            tg.start_soon(self._record_claimed)
            self.health.alive(workers=True)
            await tg.start(partial(watch, debounce_ms=self.settings.debounce_ms, on_polling=self.health.watch_polling),
                           self.roots, self._on_paths, self.reconcile)
            self.health.alive(watcher=True)
            await self.reconcile(occasion=Occasion.INITIAL)
            # after the first reconcile has kept what it keeps
            tg.start_soon(self.takeover.until_done, self.uploader.store_health)
            tg.start_soon(self.uploader.drop_stale_bundles, self.ledger.kept_roots)
            tg.start_soon(self._reconcile_loop)
            tg.start_soon(self._watch_fence)
            if self.settings.restore_point_interval > 0:
                tg.start_soon(self.points.run)
            self.health.set(Phase.READY, "restored and mirroring")
            task_status.started()

    async def _relist_after_takeover(self) -> None:
        listing = await list_store(self.store, self.roots)
        await self.reconcile_listed(listing.objects, occasion=Occasion.TAKEOVER)

    async def _watch_fence(self) -> None:
        await self.writer.fenced.wait()
        self.health.set(Phase.FENCED, self.writer.why_fenced or "fenced by a newer sidecar")

    async def _on_paths(self, paths: list[str]) -> None:
        self.ledger.note_reported(paths)
        due = self.ledger.lineage_due
        if due:
            # only in a root that is the one mirrored: a root back after it was gone is recorded
            # once its scan has decided what it is (see RootLedger.presence)
            await self._record_due([r for r in self.roots if r.name in due and self.ledger.root_intact(r)
                                    and any(is_within(p, r.path) for p in paths)])
        self.uploader.mark_paths(paths)

    async def _record_claimed(self) -> None:
        """Once our claim has succeeded, the roots held are recorded with our generation (and the
        due ones get it when recorded): a copy of this disk taken before is older than the marker."""
        generation = await self.writer.claimed_generation()
        if generation is None:
            return
        held = self.lineage
        self.lineage = lineage_of(self.store, held.namespace, generation, held.version, self.writer.lineage)
        with anyio.CancelScope(shield=True):  # a few tiny writes: a shutdown right after the claim still gets them
            for root in self.roots:
                if root.name in self.ledger.incomplete:
                    continue
                if holds(await anyio.to_thread.run_sync(read_lineage, root), held, self.startup.marker_generation):
                    await record_lineage(root, self.lineage)

    def _raise_recorded_version(self, version: int) -> None:
        """Before a write at ``version`` is sent: each root recorded as this namespace's disk says
        the store may hold ``version``, so that a copy of this disk taken before the write is
        older than the store once it lands (merged on a start, never the truth). On the event loop,
        not durable: a record rewritten per write costs a few syscalls; one lost to a power cut
        only makes this disk merged."""
        if version <= (self.lineage.version or 0):
            return
        self.lineage = replace(self.lineage, version=version)
        ledger = self.ledger
        for root in self.roots:
            if root.name in ledger.lineage_due or root.name in ledger.incomplete or root.name in ledger.unproven \
                    or not lineage_recorded(root):
                continue
            try:
                write_lineage(root, self.lineage, durable=False)
            except OSError as e:  # the next start merges this root: nothing is lost
                if self._version_unrecorded.first(root.name):
                    log.warning("lineage_unrecorded", root=root.path, error=e.strerror or type(e).__name__,
                                detail="the record's version could not be raised before a write: the next start "
                                       "merges this disk with the store instead of taking it for the truth")

    async def _record_due(self, roots: list[Root]) -> None:
        """Record the lineage of the due roots that exist now, before anything of them is queued."""
        for root in roots:
            if root.name in self.ledger.lineage_due and await record_lineage(root, self.lineage) is not None:
                self.ledger.recorded(root.name)  # recorded, or it cannot be (logged; tried again next reconcile)

    async def reconcile(self, roots: list[Root] | None = None, occasion: Occasion = Occasion.CHANGE) -> int:
        """Compare ``roots`` (all when None or empty) on disk with what the store is known to hold
        and queue the differences; how many the watcher had missed."""
        return await self._reconcile(roots or self.roots, None, occasion)

    async def reconcile_listed(self, remote: dict, occasion: Occasion = Occasion.FULL) -> int:
        """Compare every root with a fresh listing of the store (``remote``, by key), which replaces
        what the store is known to hold, and queue the differences; how many were missed."""
        return await self._reconcile(self.roots, remote, occasion)

    async def _reconcile(self, roots: list[Root], remote: dict | None, occasion: Occasion) -> int:
        """Scan ``roots``, let the ledger classify each (present, kept), and queue what
        :func:`~sidecar.plan.plan_reconcile_queue` says, each delete checked against the disk."""
        initial = occasion is Occasion.INITIAL
        ledger = self.ledger
        # what the store was known to hold before the scan: a key stored while the scan runs may be
        # missing from it (its directory was passed already) and must not be deleted for that
        known_before = self.known.keys() if remote is None else None
        local: dict[str, LocalStat] = {}
        gaps = Gaps()
        restored = self.startup.restored.restored_roots() if self.startup.restored else set()
        hidden: set[str] = set()  # roots not found intact: nothing of them deleted by this reconcile
        for root in roots:
            root_gaps = Gaps()
            reports = ledger.reported.get(root.name)
            before = await anyio.to_thread.run_sync(root_identity, root.path)
            files, _links = await anyio.to_thread.run_sync(scan_root, root, self.ignore, root_gaps)
            after = await anyio.to_thread.run_sync(root_identity, root.path)
            ledger.note_gaps(root, root_gaps)
            gaps.merge(root_gaps)
            local.update(files)
            stored = (self.known.objects_in({root.name}).keys() if remote is None
                      else {k for k in remote if k.split("/", 1)[0] == root.name})
            if before != after and after is not None:
                hidden.add(root.name)  # replaced while the scan ran: the watcher has it rescanned
            elif occasion is Occasion.TAKEOVER and after is None and self._never_there(root):
                ledger.never_there.add(root.name)  # none of it on this disk: the previous owner's late files go
            elif not await ledger.presence(root, after, files, root_gaps, stored, restored=root.name in restored,
                                           reports=reports):
                hidden.add(root.name)
            ours = initial and await self._ours(root)
            ledger.keep_root(root, bool(files), plan_root_keep(
                initial=initial, has_files=bool(files), restored=root.name in restored,
                due=root.name in ledger.lineage_due, unproven=root.name in ledger.unproven, ours=ours,
                recorded=lineage_recorded(root), cut_short=initial and restore_cut_short(root),
                stored=bool(stored) or self.startup.namespace_empty is None))
            if files and root.name in ledger.lineage_due:
                await self._record_due([root])
        names = {r.name for r in roots}
        if remote is None:
            known = self.known.objects_in(names)
        else:
            known = {k: v for k, v in remote.items() if k.split("/", 1)[0] in names}
        busy = self.uploader.pending_keys()
        await ledger.forget_kept({k for k, st in local.items() if not self.known.still_skipped(k, st)})
        plan = plan_reconcile_queue(local, known, known_before=known_before, busy=busy,
                                    still_skipped=self.known.still_skipped, protected=ledger.protected(gaps, hidden))
        upload, delete = plan.upload, plan.delete
        if delete:
            # A file can be missing from the scan and yet be on disk now: unlinked and written again
            # while the walk passed its directory, its new version stored before the scan ended.
            delete = await anyio.to_thread.run_sync(_not_on_disk, delete, {r.name: r for r in roots}, self.ignore)
        if remote is not None:  # a fresh listing replaces what we believed
            self.known.replace(names, known, busy)
        self.uploader.mark_keys(upload, delete)
        # files changed in the last moments may simply have events still on their way: queued, but
        # not counted as missed events (that metric is for alerting on real event loss)
        settled = time.time_ns() - 2_000_000_000
        fixes = sum(1 for k in upload if local[k].mtime_ns < settled) + len(delete)
        kind = "full" if remote is not None else "local"
        metrics.RECONCILES.labels(kind).inc()
        if occasion is Occasion.FINAL:
            log.info("final_rescan", upload=len(upload), delete=len(delete))
        elif occasion is Occasion.TAKEOVER:
            (log.warning if upload or delete else log.info)(
                "takeover_checked", upload=len(upload), delete=len(delete),
                detail="the store listed again once the previous owner's write window had passed: what it changed "
                       "after our restore is set back to this disk's state")
        elif fixes and not initial:
            metrics.RECONCILE_FIXES.inc(fixes)
            log.warning("reconcile_found_changes", kind=kind, upload=len(upload), delete=len(delete), missed=fixes,
                        detail="changes the watcher did not report (dropped events?) are now queued")
        elif initial:
            log.info("reconcile_start", upload=len(upload), delete=len(delete), in_sync=plan.in_sync,
                     protected=",".join(sorted(ledger.kept_roots)) or "-")
        return fixes

    def _never_there(self, root: Root) -> bool:
        """Whether ``root`` has not existed on this disk since the restore, of which the store held
        nothing then: on this disk it holds no files, so a previous owner's writes to it after our
        restore are set back (deleted) by the take-over check. A root seen in this run, or one the
        restore found stored, is gone instead (nothing deleted: a mount may be missing)."""
        ledger = self.ledger
        return (self.startup.stored_roots is not None and root.name not in self.startup.stored_roots
                and root.name not in ledger.root_ids and root.name not in ledger.gone)

    async def _reconcile_loop(self) -> None:
        s = self.settings
        if s.reconcile_interval <= 0:
            return
        last_full = time.monotonic()
        while True:
            await anyio.sleep(s.reconcile_interval)
            try:
                if s.full_reconcile_interval > 0 and time.monotonic() - last_full >= s.full_reconcile_interval:
                    listing = await list_store(self.store, self.roots)
                    await self.reconcile_listed(listing.objects)
                    last_full = time.monotonic()
                else:
                    await self.reconcile()
            except StoreError as e:
                log.warning("reconcile_failed", error=str(e))
            except Exception as e:  # never let a bug in a periodic task end the daemon
                log.error("reconcile_failed", exc=e)

    # -- phase 3: drain ----------------------------------------------------------------------
    async def drain(self, timeout: float, abandon: anyio.Event | None = None) -> int:
        """Flush what is pending within ``timeout`` seconds (or until ``abandon`` is set).
        Returns how many paths were left pending (0: everything durable)."""
        self.health.set(Phase.STOPPING, "shutting down: flushing pending changes")
        t0 = time.monotonic()
        left: list[str] | None = None
        with anyio.move_on_after(timeout) as scope:
            async with anyio.create_task_group() as tg:
                if abandon is not None:
                    async def _abandon() -> None:
                        await abandon.wait()
                        log.warning("flush_abandoned", detail="second signal")
                        scope.cancel()
                    tg.start_soon(_abandon)

                async def _fenced() -> None:  # nothing more can be written: report at once
                    await self.writer.fenced.wait()
                    scope.cancel()
                tg.start_soon(_fenced)
                await self.takeover.until_done(self.uploader.store_health)  # the store set back to our disk first
                await self.uploader.wait_idle()
                await self.reconcile(occasion=Occasion.FINAL)  # anything the watcher has not reported yet
                await self.uploader.wait_idle()
                if self.settings.restore_point_interval > 0:
                    await self._final_point()
                # What is pending at this last look is what was left: taken before another task
                # runs, so a watcher event trailing the final rescan (usually its change again)
                # comes after the drain, like any later write.
                left = sorted(self.uploader.pending_keys())
                tg.cancel_scope.cancel()
        if left is None:  # cut short (timeout, second signal, fenced)
            left = sorted(self.uploader.pending_keys())
        if not left:
            try:  # a take-over left unchecked keeps the namespace held: the next claim waits
                await self.writer.release(max(1.0, timeout - (time.monotonic() - t0)), checked=self.takeover.done)
            except StoreError as e:
                log.warning("fence_release_failed", error=str(e))
        unchecked = self.takeover.unchecked
        if unchecked:  # cut short: the store may hold what the previous owner changed after our restore
            log.error("takeover_unchecked", detail="the store was not listed again once the previous owner's write "
                      "window had passed: it may hold changes that owner made after our restore")
        totals: dict[str, Any] = self.uploader.totals.summary
        if left or unchecked:
            log.error("shutdown_pending", pending=len(left) + unchecked, paths=",".join(left[:20]),
                      seconds=round(time.monotonic() - t0, 3), **totals)
        else:
            log.info("shutdown_flushed", seconds=round(time.monotonic() - t0, 3), **totals)
        return len(left) + unchecked

    async def _final_point(self) -> None:
        """The drain's last restore point, once the uploads are done. The watcher may still report
        a change meanwhile (its events trail the final rescan): it is uploaded, and the point
        written again, a few times at most; the uploads end idle either way."""
        for _ in range(3):
            await self.points.final()
            if self.uploader.idle():
                return
            await self.uploader.wait_idle()


def _warn_nested_namespaces(roots: list[Root], listing: Listing) -> None:
    """Say once when a root's name is a session namespace nested in this one (its owner marker is
    listed): that namespace's own records are never restored, uploaded or deleted through the root."""
    unsafe = {key for key, _why in listing.unsafe}
    for root in roots:
        if f"{root.name}/{OWNER_KEY}" in unsafe:
            log.warning("root_is_namespace", root=root.path, name=root.name,
                        detail="a session namespace of this name lies in the store beside this root: its records "
                               "are left alone; name the root differently or change SIDECAR_PREFIX")


def _not_on_disk(keys: list[str], roots_by_name: dict[str, Root], ignore: IgnoreRules) -> list[str]:
    """The keys with no mirrored file at their path: none, or an ignored name, a symlink, a directory,
    a file reached through a symlinked directory (the scan does not follow those either)."""
    out = []
    for key in keys:
        name, _, rel = key.partition("/")
        root = roots_by_name.get(name)
        if root is None or ignore.ignored(rel) or not below_root_without_links(root, rel) or absent(root, rel):
            out.append(key)
    return out
