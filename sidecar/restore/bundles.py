"""The roots' bundles as a source of the latest-state restore: a snapshot commit cut short left
the newer state of the files it names (and their deletion) in its root's bundle, which replaces
their own objects where :func:`~sidecar.restore.plan.bundle_wins` says so."""

from __future__ import annotations

from typing import AsyncIterator, Sequence

from sidecar import log, metrics
from sidecar.paths import Root, UnsafeKey, split_key
from sidecar.restore.plan import generated_name, stored_counts
from sidecar.restore.state import RestoreError, Run
from sidecar.retry import retry_transient
from sidecar.snapshot import BundleError, Change, open_bundle
from sidecar.store.base import ObjectInfo, close_chunks


class Bundles(Run):
    """Reads each candidate root's bundle and places the files it decides."""

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
                    await close_chunks(opened[1])
                raise RestoreError(f"the snapshot bundle of {root.path} in {self.store.description} changed while it "
                                   "was being restored (an older sidecar is still writing); restore again")
            return opened

        async def once() -> None:
            opened = await open_checked()
            if opened is not None and not self.listed.is_set():
                await close_chunks(opened[1])
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
                await close_chunks(chunks)

        await retry_transient(once, "get", deadline)

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
        data = await self.placer.entry(root, parts, ObjectInfo(c.key, m.size, m.sha256, m.mtime_ns, m.mode), body,
                                       lambda why: BundleError(f"bundle {why}"))
        if data is None:
            return
        if name := generated_name(data):
            self.result.generated_names.add(name)
        self.progress.add(m.size)
        metrics.restored(m.size)

    def stored(self) -> dict[str, int]:
        """Files stored per root, with the bundles' changes applied."""
        objects = self.listing.objects
        bundled = {name: {key: c.deleted for key, c in overlay.items() if self._bundle_wins(name, key, objects.get(key))}
                   for name, overlay in self.overlays.items()}
        return stored_counts(self.by_name, objects, bundled)
