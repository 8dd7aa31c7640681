"""The restore's progress (files and bytes placed out of those listed so far, drawn on a terminal
or logged) and the flush of what a large restore has written while it goes on."""

from __future__ import annotations

import sys
import time

import anyio
import anyio.to_thread

from sidecar import log
from sidecar.paths import Root
from sidecar.restorefs import syncfs

PROGRESS_EVERY = 2.0


#: A large restore flushes what it has written so far in the background, each time this much more
#: has been written, so that the final flush (before the host may start) has little left to do.
FLUSH_EVERY_BYTES = 16 * 1024 * 1024


async def flush_as_it_fills(progress: "Progress", started: dict[str, Root]) -> None:
    """Flush the roots being filled in a worker thread whenever another FLUSH_EVERY_BYTES have
    been written, until cancelled when the downloads end: the disk writes while the network
    transfers, and the final flush has little left to do."""
    flushed = 0
    while True:
        if progress.bytes - flushed >= FLUSH_EVERY_BYTES:
            flushed = progress.bytes
            for root in list(started.values()):
                await anyio.to_thread.run_sync(syncfs, root.path)
        else:
            await anyio.sleep(0.02)


class Progress:
    """Files and bytes restored out of those listed so far (the listing is still growing while
    the first files land)."""

    def __init__(self) -> None:
        self.total_files = self.total_bytes = 0
        self.files = self.bytes = 0
        self.tty = sys.stderr.isatty()
        self.drawn = False
        self.last = time.monotonic()

    def expect(self, size: int) -> None:
        self.total_files += 1
        self.total_bytes += size

    def forget(self, size: int) -> None:
        """A listed file that will not be restored after all (its bundle replaced or deleted it)."""
        self.total_files -= 1
        self.total_bytes -= size

    def add(self, n: int) -> None:
        self.files += 1
        self.bytes += n
        now = time.monotonic()
        if self.tty:
            if now - self.last > 0.1:
                self.last = now
                self._draw()
        elif now - self.last > PROGRESS_EVERY:
            self.last = now
            log.info("restore_progress", files=self.files, total_files=self.total_files,
                     bytes=self.bytes, total_bytes=self.total_bytes)

    def _draw(self) -> None:
        frac = self.bytes / self.total_bytes if self.total_bytes else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(
            f"\rrestoring [{bar:<30}] {self.files}/{self.total_files} files "
            f"{self.bytes / 1048576:.1f}/{self.total_bytes / 1048576:.1f} MiB"
        )
        sys.stderr.flush()
        self.drawn = True

    def finish(self) -> None:
        if self.drawn:
            self._draw()
            sys.stderr.write("\n")
