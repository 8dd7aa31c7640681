"""The sync daemon: restore, then watch + upload + reconcile until told to stop, then drain.

Data flow (top-down)::

    prepare():  store.open → restorer.restore (downloads while the LIST streams in)
    serve():    watcher.watch ──paths──▶ Uploader.mark_paths ──▶ PendingSet ──▶ workers ──▶ store
                reconcile loop: local rescan vs known store state (no LIST), full LIST rarely
    drain():    keep watching; wait until nothing is pending (bounded), rescan once, wait again
"""

from __future__ import annotations

import os
import stat
import time
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, Iterable

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus

from sidecar import log, metrics
from sidecar.config import Settings
from sidecar.fence import OWNER_KEY, Fenced, Taken, take_for_restore
from sidecar.health import Health, Phase, RestorePhase
from sidecar.known import StoreState
from sidecar.listing import Listing, list_store
from sidecar.localfs import (
    Gaps,
    LocalStat,
    absent,
    below_root_without_links,
    has_regular_files,
    root_identity,
    scan_root,
)
from sidecar.paths import LINEAGE_FILE, IgnoreRules, Root, is_within
from sidecar.plan import Protected, RootKeep, RootPresence, plan_reconcile_queue, plan_root_keep, plan_root_presence
from sidecar.restore.latest import RestoreResult, check_foreign, lineage_of, record_lineage, restore
from sidecar.restore.plan import holds
from sidecar.restorefs import lineage_recorded, load_kept, read_lineage, restore_cut_short, save_kept
from sidecar.retry import STARTUP_RETRY_SECONDS, reported_wait, retry_transient
from sidecar.store.base import Store, StoreError

if TYPE_CHECKING:
    from sidecar.points.writer import PointWriter
    from sidecar.uploader import Uploader
    from sidecar.writer import Writer


class Daemon:
    def __init__(self, settings: Settings, roots: list[Root], store: Store) -> None:
        self.settings = settings
        self.roots = roots
        self.store = store
        self.ignore = IgnoreRules(settings.ignore)
        self.health = Health(namespace=settings.namespace.describe() if settings.namespace.path
                             or settings.namespace.identity else "")
        #: what the store is known to hold: nothing until prepare() lists it (the restore may be
        #: skipped, e.g. an unreachable store that is optional); the uploader is given this one
        self.known = StoreState()
        #: what this start's restore did (None: not run, or it found the store unreachable)
        self.restored: RestoreResult | None = None
        #: roots that were empty at start and not restored: their stored copy must not be deleted
        self.empty_roots: set[str] = set()
        #: stored keys never deleted: refused or quarantined by the restore (never placed on disk)
        self.kept_keys: set[str] = set()
        #: what the last scan of each root could not see or cannot store
        self.gaps: dict[str, Gaps] = {}
        #: the store held nothing in this compute's namespace at start (None: not listed)
        self.namespace_empty: bool | None = None
        #: the highest version stored in the namespace at start, the fence claims above it
        #: (None: not listed, the fence lists at its claim)
        self.stored_max_version: int | None = None
        #: roots still holding a cut-short restore (not restored again, e.g. ``--no-restore``): a
        #: fragment of the stored state, so their stored files are never deleted
        self.incomplete: set[str] = set()
        #: the owner marker's generation read before the restore: a root's record must be no older
        #: for the disk to be held (see sidecar.restoreplan.holds)
        self.marker_generation = 0
        #: the lineage this sidecar's roots are recorded with (see sidecar.restorer.lineage_of): the
        #: marker's generation until our claim, ours after it
        self.lineage = lineage_of(store, settings.namespace.path)
        #: roots that are this namespace's but did not exist at the restore: recorded before their
        #: first upload is queued
        self.lineage_due: set[str] = set()
        #: roots with neither this namespace's record nor a restore that filled them (not restored:
        #: ``--no-restore``, or an unreachable store with SIDECAR_RESTORE_OPTIONAL): the disk is not
        #: the truth, so their stored files are never deleted
        self.unproven: set[str] = set()
        #: whether the start-up takes the namespace over from a released owner or a pending prune
        #: before its restore (sync, run; not the one-shot restore), and what it found and did
        self.takes_over = True
        self.taken: Taken | None = None
        #: each root's directory (st_dev, st_ino) as the last scan that found it intact saw it (or
        #: as it was when mirroring began): a root with another identity was replaced as a whole
        self.root_ids: dict[str, tuple[int, int]] = {}
        #: roots gone as a whole while the store holds their files (name -> why): nothing stored
        #: of them is deleted, and the sidecar is not ready (see sidecar.plan.plan_root_presence)
        self.gone: dict[str, str] = {}
        #: roots the watcher reported themselves (removed, replaced, their attributes changed)
        #: since their last scan, each with a count: their deletes wait for that scan
        self.reported: dict[str, int] = {}
        #: set once the store was compared with the disk after a take-over, or none was needed
        #: (see check_takeover); restore points wait for it
        self.takeover_checked = anyio.Event()
        self._takeover_lock = anyio.Lock()

    @property
    def kept_roots(self) -> set[str]:
        """Roots whose stored files are never deleted: empty and not restored, cut short, or a disk
        this namespace is not known to hold."""
        return self.empty_roots | self.incomplete | self.unproven

    def protected(self, gaps: Gaps | None = None, hidden: set[str] = frozenset()) -> Protected:  # type: ignore[assignment]
        """What a reconcile must not delete now: the kept roots, the roots its scan did not find
        intact (``hidden``), the kept keys, and ``gaps`` (what its scan could not see)."""
        return Protected(frozenset(self.kept_roots | hidden), frozenset(self.kept_keys), gaps)

    def root_intact(self, root: Root) -> bool:
        """Whether a file missing in ``root`` now means the host deleted it: the root is the very
        directory the last scan found intact, not gone, replaced or reported since. Asked by the
        hints and right before each delete is sent (from worker threads too: reads and a stat)."""
        last = self.root_ids.get(root.name)
        return (last is not None and root.name not in self.gone and root.name not in self.reported
                and root_identity(root.path) == last)

    @property
    def snapshot_roots(self) -> set[str]:
        """The roots committed as crash-consistent snapshots (see sidecar.snapshot)."""
        return {r.name for r in self.roots} if self.settings.snapshot_commits() else set()

    @cached_property
    def writer(self) -> Writer:
        """The store's write gate (see writer.py), with its fence: every write of mirroring goes
        through it. Made on first use, after the restore (the fence claims above its listing)."""
        from sidecar.fence import Fence
        from sidecar.writer import Writer

        s = self.settings
        fence = Fence(self.store, s.fence_window, s.fence_margin, identity=s.namespace.identity,
                      namespace=s.namespace.path, on_wait=self.health.uploads_wait_until,
                      floor=self.stored_max_version, taken=self.taken, interval=s.heartbeat_interval,
                      store_url=s.store)
        return Writer(self.store, fence)

    @cached_property
    def uploader(self) -> Uploader:
        """Made (and imported) on first use, which is after the restore: ``run`` starts its
        child without paying for what only mirroring needs. It claims the store through the
        writer before its first write."""
        from sidecar.uploader import Uploader

        s = self.settings
        return Uploader(self.writer, self.roots, self.ignore, self.known, concurrency=s.concurrency,
                        max_file_size=s.max_file_size, snapshot_roots=self.snapshot_roots,
                        on_degraded=self.health.store_degraded, intact=self.root_intact)

    @cached_property
    def points(self) -> PointWriter:
        """The restore point writer (see pointwriter.py): made after the restore, like the
        uploader, whose idleness says when changes have settled."""
        from sidecar.points.plan import Retention
        from sidecar.points.writer import PointWriter

        s = self.settings
        return PointWriter(self.writer, self.roots, self.known, interval=s.restore_point_interval,
                           full_interval=s.restore_point_full_interval,
                           retention=Retention(s.restore_point_keep_all, s.restore_point_keep_hourly,
                                               s.restore_point_keep_daily),
                           idle=lambda: self.takeover_checked.is_set() and self.uploader.idle(),
                           wait_idle=self._wait_checked_idle,
                           excluded=lambda: (self.kept_roots, set(self.kept_keys)))

    async def _wait_checked_idle(self) -> None:
        await self.takeover_checked.wait()
        await self.uploader.wait_idle()

    # -- phase 1: restore --------------------------------------------------------------------
    async def prepare(self) -> RestoreResult | None:
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

    async def _prepare(self) -> RestoreResult:
        deadline = time.monotonic() + STARTUP_RETRY_SECONDS
        ns = self.settings.namespace
        # another namespace's volume: refused before the store is reached (the disk alone says so)
        await check_foreign(self.roots, lineage_of(self.store, ns.path), self.ignore)
        await reported_wait(partial(retry_transient, self.store.open, "open", deadline),
                            "the store to answer (and, with a managed identity, a token)", store=self.store.description)
        log.info("store", store=self.store.description, namespace=ns.describe())
        # another session's namespace is never restored from (nor, later, claimed)
        self.taken = await retry_transient(partial(take_for_restore, self.store, ns.identity, ns.path,
                                                   take=self.takes_over, store_url=self.settings.store),
                                           "read the owner marker", deadline)
        self.marker_generation = self.taken.generation
        self.lineage = lineage_of(self.store, ns.path, self.marker_generation)
        listing, result = await restore(self.store, self.roots, mode=self.settings.restore,
                                        concurrency=self.settings.concurrency, deadline=deadline,
                                        on_corrupt=self.settings.restore_corrupt, max_file_size=self.settings.max_file_size,
                                        namespace=ns.path, ignore=self.ignore, marker_generation=self.marker_generation)
        self.lineage_due = set(result.unrecorded)
        # the newest generation stored counts as the marker's: a disk recorded older is not held
        self.marker_generation = result.generation
        self.lineage = lineage_of(self.store, ns.path, self.marker_generation)
        self.namespace_empty = not listing.objects and not listing.bundles and not listing.unsafe
        self.stored_max_version = listing.max_version
        if self.namespace_empty and not self.taken.marker and not self.taken.pruned:
            log.info("namespace_empty", namespace=ns.describe(), detail="the store holds nothing in this namespace (a "
                     "new session, or one pruned after it ended): starting empty")
        assert "uploader" not in vars(self), "the uploader is made after the restore, with its listing"
        self.known = StoreState.from_listing(listing, self.snapshot_roots)  # the objects handed over, not copied
        self.restored = result
        self.health.restore_phase(RestorePhase.DONE)
        await self._keep(set(result.refused) | set(result.quarantined))
        await anyio.to_thread.run_sync(self._skip_merged_kept, result)
        _warn_nested_namespaces(self.roots, listing)
        return result

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

    async def _keep(self, refused: set[str]) -> None:
        """Add the keys this start's restore refused or set aside to those earlier starts recorded
        on this disk (``KEPT_FILE`` in each root), and record the union: a restarted sidecar beside
        the same disk must not take their absence for a deletion either."""
        for root in self.roots:
            earlier = await anyio.to_thread.run_sync(load_kept, root)
            now = {k for k in refused if k.startswith(root.name + "/")}
            self.kept_keys |= earlier | now
            if now - earlier:
                await anyio.to_thread.run_sync(save_kept, root, earlier | now)

    async def _forget_kept(self, present: set[str]) -> None:
        """Keys with a file of the host's own on disk again are mirrored as usual from now on."""
        gone = self.kept_keys & present
        if not gone:
            return
        self.kept_keys -= gone
        for root in self.roots:
            if any(k.startswith(root.name + "/") for k in gone):
                await anyio.to_thread.run_sync(save_kept, root, self.kept_keys)

    async def report_legacy_state(self) -> None:
        """When this compute's namespace and its roots are empty, look once where a release
        without namespaces kept the state (the top of ``SIDECAR_PREFIX``) and say how to adopt
        what is there: state must not be abandoned silently by an upgrade. Never fails."""
        ns = self.settings.namespace
        if ns.legacy is None or not self.namespace_empty:
            return
        empty = [r for r in self.roots if not await anyio.to_thread.run_sync(has_regular_files, r.path, self.ignore)]
        if not empty:
            return  # the host has its state (being adopted into this namespace, say)
        from sidecar.store import make_store

        found: list[str] = []
        try:
            legacy = make_store(self.settings.store_url, ns.legacy, read_only=True,  # only looked at
                                concurrency=self.settings.concurrency)
        except ValueError:
            return
        try:
            await legacy.open()
            for root in empty:
                async for _info in legacy.list(root.name + "/"):
                    found.append(root.name)
                    break
        except StoreError as e:
            log.debug("legacy_state_check_failed", error=str(e))
        finally:
            with anyio.CancelScope(shield=True):
                await legacy.aclose()
        if found and ns.project:
            import shlex

            log.warning(
                "legacy_state_found", at="the top of the store", roots=",".join(found), namespace=ns.path,
                detail=(f"the default store is shared by every project on this machine, and keeps each in a namespace "
                        f"of its own; state stored before that is at its top, and this project's namespace {ns.path} "
                        f"({ns.project}) is empty. If that state is this project's, restore it once explicitly, naming "
                        f"the store: SIDECAR_STORE={shlex.quote(str(self.settings.store))} checkpoint-sidecar restore; "
                        "run or sync then mirrors it into this namespace (docs/NAMESPACES.md)"))
        elif found:
            where = ns.legacy or "the top of the store"
            log.warning(
                "legacy_state_found", at=where, roots=",".join(found), namespace=ns.path,
                detail=(f"state stored without a session namespace is at {where}, and this compute's namespace "
                        f"{ns.path} is empty. If that state is this session's, restore it once explicitly: "
                        f"SIDECAR_PREFIX='{ns.legacy}' SIDECAR_SESSION_NAMESPACE=off checkpoint-sidecar restore; "
                        f"then remove the record naming the old place (rm {' '.join(n + '/' + LINEAGE_FILE for n in found)}: "
                        "a root another namespace recorded is refused); sync then mirrors it into this namespace "
                        "(docs/NAMESPACES.md)"))

    # -- phase 2: mirror ---------------------------------------------------------------------
    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Watch and mirror until cancelled. ``started()`` once the watch is in place and the
        first reconcile is planned (readiness)."""
        self.health.set(Phase.RECONCILING, "reconciling disk and store")
        from sidecar.watcher import watch  # imported here: ``run`` starts its child before this

        for root in self.roots:  # the directories mirroring begins with, before anything is watched
            ident = await anyio.to_thread.run_sync(root_identity, root.path)
            if ident is not None:
                self.root_ids[root.name] = ident
        async with anyio.create_task_group() as tg:
            await tg.start(self.uploader.run)
            tg.start_soon(self.writer.heartbeat, self.settings.heartbeat_interval)
            tg.start_soon(self._record_claimed)
            self.health.alive(workers=True)
            await tg.start(partial(watch, debounce_ms=self.settings.debounce_ms, on_polling=self.health.watch_polling),
                           self.roots, self._on_paths, self._on_roots_changed)
            self.health.alive(watcher=True)
            await self.reconcile(initial=True)
            tg.start_soon(self._check_takeover_until_done)  # after the first reconcile has kept what it keeps
            tg.start_soon(self.uploader.drop_stale_bundles, self.kept_roots)
            tg.start_soon(self._reconcile_loop)
            tg.start_soon(self._watch_fence)
            tg.start_soon(self.report_legacy_state)
            if self.settings.restore_point_interval > 0:
                tg.start_soon(self.points.run)
            self.health.set(Phase.READY, "restored and mirroring")
            task_status.started()

    async def check_takeover(self) -> None:
        """The take-over rule (docs/MIRRORING.md, "Fencing"): once the claim has waited out a
        predecessor that had not released the namespace, one listing of the namespace and a full
        reconcile against it. What the predecessor wrote or deleted after our restore listed the
        store is undone: the disk, restored from the store, is the namespace's truth from the
        claim on, so the store ends equal to it (what a reconcile keeps stays kept). Nothing when
        the claim did not wait. Once (the mirror and the drain both ask); raises Fenced, StoreError."""
        async with self._takeover_lock:
            if self.takeover_checked.is_set():
                return
            if await self.writer.took_over():
                listing = await list_store(self.store, self.roots)
                await self.reconcile(remote=listing.objects, takeover=True)
            self.takeover_checked.set()

    async def _check_takeover_until_done(self) -> None:
        """:meth:`check_takeover`, tried again while it fails (the store degraded meanwhile)."""
        retry = self.uploader.store_health.retry(op="takeover_check")
        while True:
            try:
                await self.check_takeover()
            except Fenced:
                return
            except Exception as e:  # a store error, or a bug: never let it end the daemon
                await retry.failed(e)
            else:
                retry.succeeded()
                return

    async def _watch_fence(self) -> None:
        await self.writer.fenced.wait()
        self.health.set(Phase.FENCED, self.writer.why_fenced or "fenced by a newer sidecar")

    async def _on_paths(self, paths: list[str]) -> None:
        # A root reported itself (removed, replaced) deletes nothing until it is scanned again: the
        # watcher rebuilds the watch and rescans it next. Its files' deletions in this batch (rm -rf)
        # are not the host deleting files one by one.
        for root in self.roots:
            if root.path in paths:
                self.reported[root.name] = self.reported.get(root.name, 0) + 1
        if self.lineage_due:
            # only in a root that is the one mirrored: a root back after it was gone is recorded
            # once its scan has decided what it is (see _presence)
            await self._record_due([r for r in self.roots if r.name in self.lineage_due and self.root_intact(r)
                                    and any(is_within(p, r.path) for p in paths)])
        self.uploader.mark_paths(paths)

    async def _record_claimed(self) -> None:
        """Once our claim has succeeded, the roots held are recorded with our generation (and the
        due ones get it when recorded): a copy of this disk taken before is older than the marker."""
        generation = await self.writer.claimed_generation()
        if generation is None:
            return
        held = self.lineage
        self.lineage = lineage_of(self.store, held.namespace, generation)
        with anyio.CancelScope(shield=True):  # a few tiny writes: a shutdown right after the claim still gets them
            for root in self.roots:
                if root.name in self.incomplete:
                    continue
                if holds(await anyio.to_thread.run_sync(read_lineage, root), held, self.marker_generation):
                    await record_lineage(root, self.lineage)

    async def _record_due(self, roots: list[Root]) -> None:
        """Record the lineage of the due roots that exist now, before anything of them is queued."""
        for root in roots:
            if root.name in self.lineage_due and await record_lineage(root, self.lineage) is not None:
                self.lineage_due.discard(root.name)  # recorded, or it cannot be (logged; tried again next reconcile)

    async def _on_roots_changed(self, roots: list[Root]) -> None:
        await self.reconcile(only=roots)

    async def reconcile(self, *, initial: bool = False, only: list[Root] | None = None,
                        remote: dict | None = None, final: bool = False, takeover: bool = False) -> int:
        """Compare the disk with what the store is known to hold and queue the differences
        (``takeover``: :meth:`check_takeover`'s, against its listing ``remote``)."""
        roots = only or self.roots
        # what the store was known to hold before the scan: a key stored while the scan runs may be
        # missing from it (its directory was passed already) and must not be deleted for that
        known_before = self.known.keys() if remote is None else None
        local: dict[str, LocalStat] = {}
        gaps = Gaps()
        restored = self.restored.restored_roots() if self.restored else set()
        hidden: set[str] = set()  # roots not found intact: nothing of them deleted by this reconcile
        for root in roots:
            root_gaps = Gaps()
            reports = self.reported.get(root.name)
            before = await anyio.to_thread.run_sync(root_identity, root.path)
            files, _links = await anyio.to_thread.run_sync(scan_root, root, self.ignore, root_gaps)
            after = await anyio.to_thread.run_sync(root_identity, root.path)
            self._note_gaps(root, root_gaps)
            gaps.merge(root_gaps)
            local.update(files)
            stored = (self.known.objects_in({root.name}).keys() if remote is None
                      else {k for k in remote if k.split("/", 1)[0] == root.name})
            if before != after and after is not None:
                hidden.add(root.name)  # replaced while the scan ran: the watcher has it rescanned
            elif not await self._presence(root, after, files, root_gaps, stored, restored=root.name in restored,
                                          reports=reports):
                hidden.add(root.name)
            ours = initial and holds(await anyio.to_thread.run_sync(read_lineage, root), self.lineage,
                                     self.marker_generation)
            self._keep_root(root, bool(files), plan_root_keep(
                initial=initial, has_files=bool(files), restored=root.name in restored,
                due=root.name in self.lineage_due, unproven=root.name in self.unproven, ours=ours,
                recorded=lineage_recorded(root), cut_short=initial and restore_cut_short(root),
                stored=bool(stored) or self.namespace_empty is None))
            if files and root.name in self.lineage_due:
                await self._record_due([root])
        names = {r.name for r in roots}
        if remote is None:
            known = self.known.objects_in(names)
        else:
            known = {k: v for k, v in remote.items() if k.split("/", 1)[0] in names}
        busy = self.uploader.pending_keys()
        await self._forget_kept({k for k, st in local.items() if not self.known.still_skipped(k, st)})
        plan = plan_reconcile_queue(local, known, known_before=known_before, busy=busy,
                                    still_skipped=self.known.still_skipped, protected=self.protected(gaps, hidden))
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
        if final:
            log.info("final_rescan", upload=len(upload), delete=len(delete))
        elif takeover:
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
                     protected=",".join(sorted(self.kept_roots)) or "-")
        return fixes

    async def _presence(self, root: Root, now: tuple[int, int] | None, files: dict[str, LocalStat], gaps: Gaps,
                        stored: Iterable[str], *, restored: bool, reports: int | None) -> bool:
        """Apply :func:`~sidecar.plan.plan_root_presence` to a scanned root (``now``: its identity,
        the same before and after the scan, else None); True when it is intact. A root gone as a whole
        is said once and makes the sidecar unready; one back without this namespace's lineage record
        (recreated by the host, another volume) keeps the stored files it lacks (``.sidecar-kept``),
        one back with it (a remount of the same disk) is compared as usual."""
        name = root.name
        if name in gaps.unreadable:
            return False  # an unreadable root: said and kept by the gaps' rule, identity unknown
        stored = set(stored)
        last = self.root_ids.get(name)
        # reported itself and its record gone: removed and made again at once (the inode reused)
        replaced = last is not None and now is not None and (now != last or (
            reports is not None and name not in self.unproven and not lineage_recorded(root)))
        presence: RootPresence = plan_root_presence(
            present=now is not None, replaced=replaced, was_gone=name in self.gone, stored=bool(stored),
            seen=last is not None or restored, has_files=bool(files))
        if presence.gone is not None:
            if name not in self.gone:
                log.warning("root_gone", root=root.path, stored=len(stored), why=presence.gone,
                            detail="the root went as a whole (removed, replaced, a mount gone): taken for unreadable, "
                                   "not for deleted; its stored files are kept and mirroring resumes when it is back")
            self.gone[name] = presence.gone
            self.health.root_gone(name, f"the root {log.printable(root.path)} is gone ({presence.gone}): its "
                                        f"{len(stored)} stored files are kept; mirroring resumes when it is back")
        elif name in self.gone:  # nothing of it is stored any more: nothing left to keep
            self.gone.pop(name)
            self.health.root_gone(name, None)
        if not presence.intact:
            return False
        if presence.returned:
            kept = sorted(stored - files.keys() - self.kept_keys)
            held = holds(await anyio.to_thread.run_sync(read_lineage, root), self.lineage, self.marker_generation)
            if held:
                kept = []  # the same disk is back (a remount): it is the truth, compared as usual
            elif kept:
                self.kept_keys |= set(kept)
                await anyio.to_thread.run_sync(save_kept, root, self.kept_keys)
            (log.info if held else log.warning)(
                "root_returned", root=root.path, files=len(files), kept=len(kept),
                detail="this namespace's disk again: compared with the store as usual" if held else
                "not this namespace's disk (no lineage record): the stored files it lacks are kept, never deleted "
                "for their absence, until the host writes them again")
        if self.gone.pop(name, None) is not None:
            self.health.root_gone(name, None)
        assert now is not None  # intact: present
        self.root_ids[name] = now
        if reports is not None and self.reported.get(name) == reports:
            del self.reported[name]  # a report that came during the scan waits for the next one
        return True

    def _keep_root(self, root: Root, has_files: bool, keep: RootKeep) -> None:
        """Apply :func:`~sidecar.plan.plan_root_keep` to the roots whose stored files are kept
        (saying once why) and to those whose lineage is due."""
        if keep.empty:
            self.empty_roots.add(root.name)
        elif keep.empty is False:
            self.empty_roots.discard(root.name)
        if keep.unproven:
            self.unproven.add(root.name)
            if has_files:
                log.warning("root_unproven_protected", root=root.path,
                            detail="this disk holds no record that this namespace filled it and it was not restored: "
                                   "its stored files are kept (never deleted); a restore merges them in")
        if keep.due:
            self.lineage_due.add(root.name)  # the host removed the root, and the record with it
        if keep.incomplete:
            self.incomplete.add(root.name)
            log.warning("restore_incomplete_root_protected", root=root.path,
                        detail="an earlier restore into this root was cut short and it was not restored again; "
                               "its stored files are kept (never deleted) until a restore completes")

    def _note_gaps(self, root: Root, gaps: Gaps) -> None:
        """Say once what a scan cannot see or store (and when it can again); a root that cannot
        be read makes the sidecar unready: nothing of it would be mirrored."""
        seen = self.gaps.get(root.name, Gaps())
        for d, why in gaps.unreadable.items():
            if d not in seen.unreadable:
                log.error("directory_unreadable", path=d, error=why,
                          detail="its stored files are kept, and nothing below it is mirrored until it can be read "
                                 "(run the sidecar as the host's user, or fix the permissions)")
        for d in seen.unreadable.keys() - gaps.unreadable.keys():
            log.info("directory_readable_again", path=d)
        for key in set(gaps.unstorable) - set(seen.unstorable):
            log.error("file_unstorable", path=key, detail="its path is longer than a store name may be: never mirrored")
        self.gaps[root.name] = gaps
        self.health.root_readable(root.name, f"cannot read {root.path}: {gaps.unreadable[root.name]}"
                                  if root.name in gaps.unreadable else None)

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
                    await self.reconcile(remote=listing.objects)
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
                    await self.uploader.fenced.wait()
                    scope.cancel()
                tg.start_soon(_fenced)
                await self._check_takeover_until_done()  # the store set back to our disk first
                await self.uploader.wait_idle()
                await self.reconcile(final=True)  # anything the watcher has not reported yet
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
                await self.writer.release(max(1.0, timeout - (time.monotonic() - t0)), checked=self.takeover_checked)
            except StoreError as e:
                log.warning("fence_release_failed", error=str(e))
        unchecked = self.writer.waited and not self.takeover_checked.is_set()
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
