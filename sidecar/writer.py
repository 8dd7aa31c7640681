"""The write gate: every store mutation of a running sidecar goes through one :class:`Writer`.

Rule: no write before the claim, each write right after a proof of ownership younger than the
fence's window (:meth:`sidecar.fence.Fence.before_write`: a marker read at most once per window),
none once fenced or released, and each write stamped with the next version
(:meth:`~sidecar.fence.Fence.next_version`). The writer satisfies the store interface, so per-file
puts and deletes (:mod:`sidecar.uploader`), snapshot bundles and their cleanup
(:class:`sidecar.snapshot.Committer`) hold it instead of the store; reads pass through unchanged.
The owner marker is not the writer's: it refuses to write it, and the fence's own reads and
writes go to the store directly, through :mod:`sidecar.marker`.

Work that takes long before a write (reading and hashing a file, listing the store) waits for
:meth:`Writer.ready` first, which proves nothing: the proof is taken inside :meth:`Writer.put` and
:meth:`Writer.delete`, after that work, right before the request.
"""

from __future__ import annotations

from dataclasses import replace
from typing import AsyncIterator, Callable

import anyio

from sidecar import log, metrics
from sidecar.fence import Fence, Fenced
from sidecar.marker import OWNER_KEY
from sidecar.store.base import ObjectInfo, ObjectMeta, Source, Store, StoreError, Stream


class Writer:
    """A :class:`~sidecar.store.base.Store` whose mutations are fenced (see the module docstring).
    Without a fence (tests, tools), writes are not gated and carry version 0."""

    def __init__(self, store: Store, fence: Fence | None = None) -> None:
        self._store = store
        self._fence = fence
        self.description = store.description
        #: set once a newer sidecar owns the namespace: nothing more is written
        self.fenced = anyio.Event()
        #: told each version before a write carrying it is sent (the daemon raises the roots'
        #: lineage records with it: see sidecar.restorefs.Lineage)
        self.on_version: Callable[[int], None] = lambda version: None

    # -- the gate --------------------------------------------------------------------------
    @property
    def why_fenced(self) -> str | None:
        """Why this sidecar was fenced (the fence's one line), None while it was not."""
        return self._fence.fenced if self._fence is not None else None

    def _note_fenced(self) -> None:
        if self._fence is not None and self._fence.released and not self._fence.fenced:
            return  # released on a clean exit: refused, but nobody fenced us
        if not self.fenced.is_set():
            self.fenced.set()
            metrics.FENCED.set(1)

    @property
    def lineage(self) -> str | None:
        """The namespace's lineage id our marker carries, once claimed (None before, or no fence)."""
        return self._fence.lineage if self._fence is not None else None

    async def claim(self) -> None:
        """Claim the namespace (:meth:`Fence.claim`); raises :class:`Fenced` or ``StoreError``."""
        if self._fence is None:
            return
        try:
            await self._fence.claim()
        except Fenced:
            self._note_fenced()
            raise

    async def claimed_generation(self) -> int | None:
        """Once the claim has ended: the generation this sidecar holds the namespace at (None:
        fenced, or no fence)."""
        return None if self._fence is None else await self._fence.claimed_generation()

    @property
    def waited(self) -> bool:
        """Whether the claim waited out a predecessor that had not released the namespace."""
        return self._fence is not None and self._fence.waited

    async def took_over(self) -> bool:
        """Once the claim has ended and a held predecessor's write window has passed: whether the
        claim waited one out (its late writes and deletes may have changed what our restore
        listed, see docs/MIRRORING.md, "Fencing"). False without a fence or when fenced
        (:meth:`ready` raises :class:`Fenced` when fenced during the wait)."""
        if await self.claimed_generation() is None or not self.waited:
            return False
        await self.ready()
        return True

    async def ready(self) -> None:
        """Wait for the claim and a predecessor's write window: call before work that precedes
        a write (reading a file, listing the store). Proves nothing; raises :class:`Fenced`."""
        if self._fence is None:
            return
        try:
            await self._fence.wait_writable()
        except Fenced:
            self._note_fenced()
            raise

    async def _prove(self) -> None:
        if self._fence is None:
            return
        try:
            await self._fence.before_write()
        except Fenced:
            self._note_fenced()
            raise

    def newer(self, info: ObjectInfo) -> bool:
        """Whether a put's answer is a newer owner's object (stored at a version above any this
        sidecar writes), so that nothing of ours was stored."""
        return info.version > (self._fence.newest_version() if self._fence is not None else 0)

    async def heartbeat(self, interval: float) -> None:
        """Every ``interval`` seconds (0: never), the fence's heartbeat, from the claim until
        fenced; a failing heartbeat is logged and tried again at the next interval."""
        if self._fence is None or interval <= 0:
            return
        while True:
            await anyio.sleep(interval)
            try:
                await self._fence.heartbeat()
            except Fenced:
                self._note_fenced()
                return
            except StoreError as e:
                log.warning("heartbeat_failed", error=str(e))
            except Exception as e:  # never let a bug in a periodic task end the daemon
                log.error("heartbeat_failed", exc=e)

    async def release(self, timeout: float, checked: anyio.Event | None = None) -> None:
        """On a clean exit: :meth:`Fence.release`; no write follows. ``checked``: unless it is set,
        a claim that waited out a predecessor keeps the namespace held (:meth:`took_over`)."""
        if self._fence is not None:
            await self._fence.release(timeout, checked)

    # -- the store interface ---------------------------------------------------------------
    def reserve_version(self) -> int:
        """A version for a write whose key must name it (a restore point's seq), taken now and
        given to :meth:`put` as ``version``; 0 without a fence or before the claim."""
        return self._versioned(self._fence.next_version()) if self._fence is not None else 0

    def _versioned(self, version: int) -> int:
        self.on_version(version)
        return version

    async def put(self, key: str, data: bytes | Source, meta: ObjectMeta, if_version: int | None = None, *,
                  expected: ObjectInfo | None = None, version: int | None = None) -> ObjectInfo:
        """Prove ownership, stamp ``meta`` with the next version (or ``version``, reserved by
        :meth:`reserve_version`), then put (raises :class:`Fenced`). The store's signature, plus
        ``version``: ``if_version`` and ``expected`` as for :meth:`Store.put <sidecar.store.base.Store.put>`."""
        _refuse_marker(key)
        await self._prove()
        if version is None:
            version = self._versioned(self._fence.next_version()) if self._fence is not None else 0
        return await self._store.put(key, data, replace(meta, version=version), if_version=if_version, expected=expected)

    async def delete(self, key: str) -> None:
        """Prove ownership, then delete (raises :class:`Fenced`)."""
        _refuse_marker(key)
        await self._prove()
        await self._store.delete(key)

    async def delete_if(self, key: str, version: int) -> bool:
        """Prove ownership, then delete while at ``version`` (raises :class:`Fenced`)."""
        _refuse_marker(key)
        await self._prove()
        return await self._store.delete_if(key, version)

    async def now(self) -> float:
        return await self._store.now()

    flat_namespace = property(lambda self: self._store.flat_namespace)
    clock_is_local = property(lambda self: self._store.clock_is_local)

    async def open(self) -> None:
        await self._store.open()

    async def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        return await self._store.get(key)

    async def get_stream(self, key: str, read_ahead: int = 0) -> Stream:
        return await self._store.get_stream(key, read_ahead)

    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        return self._store.list(prefix)

    async def aclose(self) -> None:
        await self._store.aclose()


def _refuse_marker(key: str) -> None:
    if key == OWNER_KEY:
        raise ValueError("the owner marker is written by the fence only")
