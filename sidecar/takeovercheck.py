"""The take-over check (docs/MIRRORING.md, "Fencing"): once our claim has waited out a predecessor
that had not released the namespace, the store is listed once more and reconciled against it.

What the predecessor wrote or deleted after our restore listed the store is undone: the disk,
restored from the store, is the namespace's truth from the claim on, so the store ends equal to it
(what a reconcile keeps stays kept). Nothing when the claim did not wait. Restore points wait for
:attr:`TakeoverCheck.done`; a release leaves the namespace held while it is unset.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import anyio

from sidecar.fence import Fenced
from sidecar.retry import StoreHealth
from sidecar.writer import Writer


class TakeoverCheck:
    """The check, once (the mirror and the drain both ask). ``relist``: list the namespace and
    reconcile against the listing (the daemon's)."""

    def __init__(self, writer: Writer, relist: Callable[[], Awaitable[object]]) -> None:
        self.writer = writer
        self._relist = relist
        #: set once the store was compared with the disk after a take-over, or none was needed
        self.done = anyio.Event()
        self._lock = anyio.Lock()

    @property
    def unchecked(self) -> bool:
        """Whether the claim waited out a predecessor and the store was not compared since: it may
        hold changes that owner made after our restore."""
        return self.writer.waited and not self.done.is_set()

    async def check(self) -> None:
        """Compare the store with the disk once the claim has ended and a held predecessor's write
        window has passed, if the claim waited one out. Raises Fenced, StoreError."""
        async with self._lock:
            if self.done.is_set():
                return
            if await self.writer.took_over():
                await self._relist()
            self.done.set()

    async def until_done(self, health: StoreHealth) -> None:
        """:meth:`check`, tried again while it fails (the store degraded meanwhile); ends when
        fenced."""
        retry = health.retry(op="takeover_check")
        while True:
            try:
                await self.check()
            except Fenced:
                return
            except Exception as e:  # a store error, or a bug: never let it end the daemon
                await retry.failed(e)
            else:
                retry.succeeded()
                return
