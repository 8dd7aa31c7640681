"""The one placer of the restore: every restored file, from its own object, its root's bundle or
a restore point, latest state or ``restore --as-of``, is written here, inline or streamed, never
outside its root (:func:`~sidecar.restorefs.write_restored`, :class:`~sidecar.restorefs.RestoreTemp`),
verified against its sha256; a refused target, a checksum that does not match and a full disk are
each met the same way whichever source fed the file (:class:`Placer`)."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import anyio
import anyio.abc
import anyio.to_thread

from sidecar import log
from sidecar.localfs import UnsafeTarget
from sidecar.paths import Root
from sidecar.restorefs import ChecksumMismatch, OpenDirs, RestoreTemp, write_restored
from sidecar.store.base import ObjectInfo

#: Restored files up to this size are written on the event loop, where that costs less than a
#: hand-off to a worker thread and back; larger ones in a worker thread.
INLINE_WRITE_MAX = 256 * 1024

#: Small files taken from a point are written in worker threads, a batch at a time (at most
#: BATCH_FILES files or BATCH_BYTES bytes a batch, WRITE_BATCHES batches in flight): creating files
#: is most of a restore of small files, and it then overlaps the point's download and itself. The
#: bytes waiting to be written stay under (1 + WRITE_BATCHES) x BATCH_BYTES.
BATCH_FILES = 64
BATCH_BYTES = 1024 * 1024
WRITE_BATCHES = 4


@dataclass
class Small:
    """A small file whose bytes were read and checked (its point's entry sha256), to be placed."""

    root: Root
    parts: list[str]
    info: ObjectInfo
    data: bytes


def write_batch(batch: list[Small]) -> list[Exception | None]:
    """Blocking: place each file of ``batch`` (:func:`~sidecar.restorefs.write_restored`), its
    directories opened once; per file None, or the :class:`~sidecar.localfs.UnsafeTarget` or
    ``OSError`` that kept it out (the files after an ``OSError`` are not tried: their outcome is it too)."""
    dirs = OpenDirs()
    out: list[Exception | None] = []
    try:
        for i, s in enumerate(batch):
            try:
                write_restored(s.root, s.parts, s.data, s.info.mtime_ns, s.info.mode, None, dirs)
                out.append(None)
            except UnsafeTarget as e:
                out.append(e)
            except OSError as e:
                return out + [e] * (len(batch) - i)
    finally:
        dirs.close()
    return out


class BatchWriter:
    """Writes :class:`Small` files in worker threads, a batch at a time, in ``tg``; ``done`` is
    called on the event loop with each file and its outcome (None: placed). :meth:`add` waits while
    WRITE_BATCHES batches are being written; :meth:`flush` hands over the last one."""

    def __init__(self, tg: anyio.abc.TaskGroup, done: Callable[[Small, Exception | None], None]) -> None:
        self._tg, self._done = tg, done
        self._pending: list[Small] = []
        self._bytes = 0
        self._slots = anyio.Semaphore(WRITE_BATCHES)

    async def add(self, small: Small) -> None:
        self._pending.append(small)
        self._bytes += len(small.data)
        if len(self._pending) >= BATCH_FILES or self._bytes >= BATCH_BYTES:
            await self.flush()

    async def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending, self._bytes = self._pending, [], 0
        await self._slots.acquire()
        self._tg.start_soon(self._write, batch)

    async def _write(self, batch: list[Small]) -> None:
        try:
            outcomes = await anyio.to_thread.run_sync(write_batch, batch)
        finally:
            self._slots.release()
        for small, outcome in zip(batch, outcomes, strict=True):
            self._done(small, outcome)


async def write_streamed(root: Root, parts: list[str], chunks: AsyncIterator[bytes], got: ObjectInfo,
                         expected: str | None) -> None:
    """Write a large object as its chunks arrive (each write in a worker thread), then verify and
    place it (:class:`~sidecar.restorefs.RestoreTemp`); nothing is left behind on failure."""
    temp = await anyio.to_thread.run_sync(RestoreTemp, root, parts)
    try:
        async for chunk in chunks:
            await anyio.to_thread.run_sync(temp.write, chunk)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(temp.abort)
        raise
    await anyio.to_thread.run_sync(temp.finish, got.mtime_ns, got.mode, expected)


class Placer:
    """Places the files of one restore. ``error`` is the restore's failure (a write that fails:
    one line, a full disk saying how many files ``landed`` first when it counts them, then
    ``after``); ``refused`` accounts for a file refused as a target (logged here)."""

    def __init__(self, error: Callable[[str], Exception], refused: Callable[[str, int], None],
                 landed: Callable[[], int] | None = None, after: str = "") -> None:
        self.error, self.refused, self.landed, self.after = error, refused, landed, after
        self.dirs = OpenDirs()  # for the files written on the event loop, not in threads

    def close(self) -> None:
        self.dirs.close()

    def refuse(self, key: str, e: UnsafeTarget, size: int) -> None:
        log.error("restore_refused_target", path=key, reason=str(e))
        self.refused(key, size)

    def failed(self, root: Root, key: str, e: Exception) -> Exception:
        """Why a file could not be written; a full disk says how many landed, never a total."""
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            landed = "" if self.landed is None else f"{log.count(self.landed(), 'file')} restored before it filled up; "
            return self.error(f"no space left on device while restoring into {root.path} ({landed}no partial file "
                              f"left{self.after})")
        return self.error(f"cannot write {key} into {root.path}: {getattr(e, 'strerror', None) or e}")

    async def write(self, root: Root, parts: list[str], info: ObjectInfo, data: bytes | AsyncIterator[bytes],
                    expected: str | None) -> bool:
        """Write one file, verified against ``expected`` (None: its bytes were checked as they
        arrived, or it has no sha256): its bytes (``data``) or, too large to hold, its chunks, written
        as they arrive (:func:`write_streamed`). Small bytes are written right here, where it costs
        less than the hand-off to a thread and back; larger ones in a worker thread (hashing 100 MiB
        in the event loop would stall the other downloads). True: placed; False: refused as a
        target. :class:`~sidecar.restorefs.ChecksumMismatch` is the caller's (nothing is left)."""
        try:
            if not isinstance(data, bytes):
                await write_streamed(root, parts, data, info, expected)
            elif len(data) > INLINE_WRITE_MAX:
                await anyio.to_thread.run_sync(write_restored, root, parts, data, info.mtime_ns, info.mode, expected)
            else:
                write_restored(root, parts, data, info.mtime_ns, info.mode, expected, self.dirs)
        except UnsafeTarget as e:
            self.refuse(info.key, e, info.size)
            return False
        except ChecksumMismatch:
            raise
        except OSError as e:
            raise self.failed(root, info.key, e) from None
        return True

    async def entry(self, root: Root, parts: list[str], info: ObjectInfo, body: AsyncIterator[bytes],
                    corrupt: Callable[[str], Exception]) -> bytes | None:
        """Write one entry of a bundle or a point (its reader checks the bytes against ``info.sha256``
        as they arrive): held and written at once up to INLINE_WRITE_MAX, else streamed. Its bytes
        (b"" when streamed); None when refused. Bytes that do not match raise ``corrupt``."""
        inline = info.size <= INLINE_WRITE_MAX
        data = b"".join([chunk async for chunk in body]) if inline else b""
        try:
            if not await self.write(root, parts, info, data if inline else body, None if inline else info.sha256):
                return None
        except ChecksumMismatch:
            raise corrupt(f"entry {info.key!r} does not match its sha256") from None
        return data


def batch_outcome(small: Small, outcome: Exception | None, placer: Placer) -> bool:
    """A file of a batch written (``outcome`` None: True), or kept out: refused (False), or
    failed (raised, as :meth:`Placer.failed` says)."""
    if outcome is None:
        return True
    if isinstance(outcome, UnsafeTarget):
        placer.refuse(small.info.key, outcome, small.info.size)
        return False
    raise placer.failed(small.root, small.info.key, outcome)
