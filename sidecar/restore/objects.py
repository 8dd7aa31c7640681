"""The stored objects as a source of the latest-state restore: the listing, streamed, queues the
candidate roots' files (those the restore points do not give) as each page arrives, and
``concurrency`` workers download, verify and place them meanwhile (:class:`Objects`)."""

from __future__ import annotations

from typing import Iterable

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream

from sidecar import log, metrics
from sidecar.localfs import STREAM_MIN, body_bytes, local_matches
from sidecar.paths import Root, split_key
from sidecar.restore.bundles import Bundles
from sidecar.restore.plan import FileAction, file_action, generated_name, names_generated, older_copies, stored_generation
from sidecar.restore.state import UNVERIFIED_SHOWN, Item, Parts, RestoreError
from sidecar.restorefs import ChecksumMismatch, remove_stale_restore_temps
from sidecar.retry import retry_transient
from sidecar.store.base import NotFound, ObjectInfo, close_chunks


class Objects(Bundles):
    """Lists the store and places the listed files of the roots being filled from their objects."""

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
                        version=self.disk[name].version, stored_version=self.listing.own_max_version,
                        detail="this disk's record is older than what the store holds (a copy taken before more "
                               "was written): not the truth; merged, nothing stored is deleted")
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

    async def work(self, receive: MemoryObjectReceiveStream[Item]) -> None:
        async with receive:
            async for root, info in receive:
                async with self.bodies.hold(body_bytes(info.size)):  # memory bounded by design
                    await self._place(root, info)

    async def _place(self, root: Root, info: ObjectInfo) -> None:
        """Restore one listed file as :func:`~sidecar.restore.plan.file_action` says."""
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

    async def _fetch(self, root: Root, info: ObjectInfo, parts: Parts, streamed: bool) -> tuple[int, bytes] | None:
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
                    await close_chunks(chunks)
                return None
            expected = got.sha256 or info.sha256
            if expected is None and attempt == 1:
                self.result.unverified += 1
                if self.result.unverified <= UNVERIFIED_SHOWN:
                    log.warning("restore_unverified", path=info.key,
                                detail="no sha256 is recorded for it (written by another tool, or a put cut "
                                       "short): restored as stored, unchecked")
            try:
                if await self.placer.write(root, parts, got, chunks if streamed else data, expected):
                    break
                return None  # refused
            except ChecksumMismatch:
                log.warning("restore_checksum_mismatch", path=info.key, attempt=attempt)
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

