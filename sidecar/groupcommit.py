"""Group commit: many callers wait for a value to be written, and one write covers them all."""

from __future__ import annotations

from typing import Awaitable, Callable

import anyio


class GroupCommit:
    """``await cover(n)`` returns once a ``write(m)`` with ``m >= n`` has completed. Writes run
    one at a time: the callers that arrive while one runs are covered together by the next, which
    writes the highest value asked so far. A write that raises covers nobody (its caller gets the
    error; the others try again)."""

    def __init__(self, write: Callable[[int], Awaitable[None]]) -> None:
        self._write = write
        self.written = 0  # the highest value a completed write covered
        self._wanted = 0
        self._running: anyio.Event | None = None

    async def cover(self, n: int) -> None:
        self._wanted = max(self._wanted, n)
        while n > self.written:
            if self._running is not None:
                await self._running.wait()
                continue
            self._running = running = anyio.Event()
            try:
                wanted = self._wanted
                await self._write(wanted)
                self.written = max(self.written, wanted)
            finally:
                self._running = None
                running.set()
