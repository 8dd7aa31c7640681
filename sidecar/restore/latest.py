"""The latest-state restore: bring every stored file of every root back before the host starts.

The listing is streamed: files are queued as each page of it arrives, and ``concurrency``
workers download them meanwhile (:mod:`.objects`), so the first files land while the rest of the
listing is still being fetched and parsed; the roots' bundles (:mod:`.bundles`) and the restore
points (:mod:`.points`) feed the same placer (:mod:`.place`). Each file is verified against its
sha256 and renamed into place; a stored name never lands outside its root. The restored
filesystem is flushed at the end (a large restore also as it fills) so a power loss cannot leave
empty files that a later ``sync`` would take for the truth. A root gets a restore marker before
its first file and loses it after the flush (:mod:`.finish`), so a restore cut short is known as
such. Which roots are restored, which files come from where and what is recorded follow
:mod:`.plan` (pure); a root that is this namespace's disk once the restore ends gets its lineage
record, after its files are flushed and before its marker goes.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import AsyncIterator

import anyio
import anyio.to_thread

from sidecar import log, metrics
from sidecar.errors import leaves
from sidecar.listing import Listing
from sidecar.localfs import has_regular_files
from sidecar.paths import IgnoreRules, Root, split_key
from sidecar.restore import plan
from sidecar.restore.finish import finish, lineage_of, record_lineage
from sidecar.restore.objects import Objects
from sidecar.restore.place import INLINE_WRITE_MAX, BatchWriter, Small, batch_outcome
from sidecar.restore.plan import Disk, foreign, foreign_refusal, holds, unreadable_refusal
from sidecar.restore.progress import flush_as_it_fills
from sidecar.restore.state import RestoreError, RestoreResult
from sidecar.restorefs import Lineage, read_lineage, read_lineage_why, remove_stale_restore_temps, restore_cut_short
from sidecar.snapshot import Change
from sidecar.store.base import ObjectInfo, ObjectMeta, Store, StoreError

__all__ = ["ForeignDisk", "RestoreError", "RestoreResult", "check_foreign", "lineage_of", "record_lineage", "restore"]


class _Restore(Objects):
    """One latest-state restore: its sources (the objects, the bundles and, here, the points)."""

    async def from_points(self, deadline: float) -> None:
        """Open the restore points and read them while the store is listed, placing each file
        taken from them as the listing offers it (:mod:`.points`); those they did not
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
            if name := plan.generated_name(data):
                self.result.generated_names.add(name)
            await self.point_writes.add(Small(root, parts, info, data))
            return
        meta = ObjectMeta(info.size, info.sha256 or "", info.mtime_ns, info.mode, info.version)
        await self._place_bundled(root, Change(info.key, None, meta), body)

    def _written(self, small: Small, outcome: Exception | None) -> None:
        """A file of a point's batch written (``outcome`` None), or kept out."""
        if batch_outcome(small, outcome, self.placer):
            self.progress.add(small.info.size)
            metrics.restored(small.info.size)

    async def feed(self, concurrency: int, deadline: float) -> None:
        """Run the workers and the sources until every file is placed, then decide each root
        (:func:`~sidecar.restore.plan.decide_roots`)."""
        async with anyio.create_task_group() as workers:
            for _ in range(concurrency):
                workers.start_soon(self.work, self.receive.clone())
            self.receive.close()
            async with self.send:  # closed once every file is queued: the workers then drain and end
                async with anyio.create_task_group() as feeders:
                    self.feeders = feeders
                    for root in self.candidates.values():  # first: their requests go out before the listing's next page
                        feeders.start_soon(self.overlay, root, deadline)
                    feeders.start_soon(self.list, deadline)
                    feeders.start_soon(self.from_points, deadline)
                self.decide()

    def decide(self) -> None:
        """Once every file is placed: each root's decision, by what the listing and the bundles say is stored."""
        candidates = self.candidates
        for name in plan.commits_begun_meanwhile(candidates, self.listing.bundles, self.bundles_read):
            raise RestoreError(
                f"a snapshot commit of {candidates[name].path} began in {self.store.description} while "
                "it was being restored (an older sidecar is still writing); restore again")
        stored = self.stored()
        for name in self.older:  # held by its record, older than the store: merged
            self.disk[name] = replace(self.disk[name], held=False, older=True)
        self.result.decisions = plan.decide_roots(self.disk, stored, self.mode)
        for root, d in zip(self.by_name.values(), self.result.decisions, strict=True):
            log.info("restore_decision", root=root.path, restore=d.restore, reason=d.reason, stored=stored[root.name])


async def restore(store: Store, roots: list[Root], *, mode: str = "auto", concurrency: int = 16,
                  deadline: float = 0.0, on_corrupt: str = "fail", max_file_size: int = 2**63, namespace: str = "",
                  ignore: IgnoreRules | None = None, marker_generation: int = 0,
                  marker_lineage: str | None = None) -> tuple[Listing, RestoreResult]:
    """Restore by the rule (:func:`~sidecar.restore.plan.decide_restore`) while the store is listed; the
    listing (the store's content, for mirroring) and what was restored. A listing or bundle read
    that fails transiently is retried until ``deadline`` (monotonic; by default not at all). An
    object whose bytes do not match their recorded sha256 fails the restore (``on_corrupt="fail"``)
    or is left out and reported in ``RestoreResult.quarantined`` (``"skip"``). ``namespace``
    names, with the store's description, the lineage (:func:`lineage_of`) the roots are checked
    against and recorded with; ``marker_generation``, the generation of the namespace's owner
    marker read before the restore: a root is held only when its record's generation is no older
    and its lineage id (``marker_lineage``, the marker's) the same (:func:`~sidecar.restore.plan.holds`),
    and the roots recorded now carry them. Files ``ignore`` says
    are never mirrored (by default, the default rules) do not make a root hold files."""
    t0, result = time.monotonic(), RestoreResult()
    lineage = lineage_of(store, namespace, marker_generation, marker=marker_lineage)
    # Which roots may be filled depends on the disk alone; whether anything is stored for them
    # is known when the listing ends, and a root gets its restore marker with its first file.
    disk = {root.name: await _read_disk(root, lineage, ignore) for root in roots}
    chosen = plan.plan_candidates(disk, mode)
    candidates = {r.name: r for r in roots if r.name in chosen.roots}
    for root in candidates.values():
        await anyio.to_thread.run_sync(remove_stale_restore_temps, root)
    run = _Restore(store, roots, candidates, result, on_corrupt, max_file_size, chosen.merging, disk, mode)
    try:
        async with anyio.create_task_group() as flushing:
            flushing.start_soon(flush_as_it_fills, run.progress, run.started)
            await run.feed(concurrency, deadline)
            flushing.cancel_scope.cancel()  # every download ended (a flush under way completes)
    except BaseExceptionGroup as eg:
        raise _cause(eg, run) from None
    finally:
        run.placer.close()
    run.progress.finish()
    # the roots recorded now hold the namespace's state as stored: of its newest generation
    result.generation = max(marker_generation, plan.stored_generation(run.listing.own_max_version))
    # ...and the highest version stored of it (a copy of this disk is older once anything newer is)
    await finish(plan.plan_finish(result.decisions, disk, candidates, set(run.started)), {r.name: r for r in roots},
                 replace(lineage, generation=result.generation, version=run.listing.own_max_version),
                 result.unrecorded)
    result.files, result.bytes = run.progress.files, run.progress.bytes
    result.seconds = time.monotonic() - t0
    _report(result, merged=bool(chosen.merging) or bool(run.older and mode == "auto"))
    return run.listing, result


def _cause(eg: BaseExceptionGroup, run: _Restore) -> BaseException:
    """The first real cause of a restore that failed, to raise in one line."""
    for exc in leaves(eg):
        if isinstance(exc, StoreError) and run.started:
            # Files are already in place: the roots hold a fragment now, which must not
            # pass for a restore that found the store unreachable (SIDECAR_RESTORE_OPTIONAL
            # starts the host then). Their markers stay: the next start restores them again.
            return RestoreError(f"cut short after {run.progress.files} files: {exc}")
        if isinstance(exc, (RestoreError, StoreError)):
            return exc
    return eg


class ForeignDisk(Exception):
    """A root holds files another store or namespace put there (its lineage record names them):
    never restored into, never mirrored into this namespace (one line: both namespaces, the fix)."""


async def check_foreign(roots: list[Root], lineage: Lineage, ignore: IgnoreRules | None) -> None:
    """Raise :class:`ForeignDisk` for the first root that holds files and a record naming another
    store or namespace than ``lineage``'s (:func:`~sidecar.restore.plan.foreign`), or a record
    that cannot be read (it may name another: never taken for none). Reads the disk only:
    before the store is reached, so an unreachable store (``SIDECAR_RESTORE_OPTIONAL``) lets none by."""
    for root in roots:
        record, why = await anyio.to_thread.run_sync(read_lineage_why, root)
        if why is not None:
            refusal = unreadable_refusal(root.path, why, lineage, log.printable)
        elif record is not None and foreign(record, lineage):
            refusal = foreign_refusal(root.path, record, lineage, log.printable)
        else:
            continue
        if await anyio.to_thread.run_sync(has_regular_files, root.path, ignore):
            raise ForeignDisk(refusal)


async def _read_disk(root: Root, lineage: Lineage, ignore: IgnoreRules | None) -> Disk:
    """What the disk says of ``root`` before the restore (see :class:`~sidecar.restore.plan.Disk`);
    ``lineage`` carries the marker's generation."""
    record = await anyio.to_thread.run_sync(read_lineage, root)
    _warn_other_lineage(root, lineage, record)
    held = holds(record, lineage, lineage.generation or 0)
    return Disk(has_files=await anyio.to_thread.run_sync(has_regular_files, root.path, ignore),
                cut_short=restore_cut_short(root), held=held,
                generation=record.generation if held and record is not None else None,
                version=record.version if held and record is not None else None)


def _warn_other_lineage(root: Root, lineage: Lineage, recorded: Lineage | None) -> None:
    """Say so when ``root`` records another store or namespace (and holds no files:
    :func:`check_foreign` refused those): it is filled from the store, never silently."""
    if recorded is not None and foreign(recorded, lineage):
        log.warning("lineage_other", root=root.path, recorded_store=recorded.store,
                    recorded_namespace=recorded.namespace or "-", store=lineage.store,
                    namespace=lineage.namespace or "-",
                    detail="this disk was filled or mirrored by another store or namespace: it is not the truth "
                           "here; it holds no files, and is filled from the store")


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
