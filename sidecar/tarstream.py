"""Streamed tar archives with a JSON header member first: the one format of snapshot bundles
(:mod:`sidecar.snapshot`) and restore points (:mod:`sidecar.points`).

An archive is a POSIX tar (pax headers where a name needs them): its first member is a JSON header
(named by the caller: ``.sidecar-bundle.json``, ``.sidecar-point.json``), then one regular member per
file, named by its key, holding its bytes, then the end-of-archive blocks. Written a chunk at a time
(:func:`tar_chunks`, :class:`TarSource` for a store's streamed put) and read a chunk at a time as
they arrive (:class:`TarReader`), each member's bytes checked against the sha256 its header gives:
no file is ever held whole. Pure but for the reads of streamed files (blocking, in
:func:`tar_chunks`) and the awaited chunks of a reader.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterable, Iterator, Protocol

import anyio.to_thread

from sidecar.localfs import Unstable
from sidecar.store.base import CHUNK_BYTES, ObjectMeta

BLOCK = tarfile.BLOCKSIZE
#: An archive's header is read and parsed whole, so it is bounded: a header longer than this, or
#: naming more entries than that, is refused as unreadable. Parsing one at the limits holds about
#: 10x its bytes (measured: 50,000 written entries of 60-byte keys, 9 MiB, peak +85 MiB; any JSON
#: of 8 MiB at most about 12x).
MAX_HEADER_BYTES = 8 * 1024 * 1024
MAX_ENTRIES = 50_000
#: A pax extended header longer than this is refused (a name is at most a few KiB).
MAX_PAX_BYTES = 1024 * 1024


class Streamed(Protocol):
    """Bytes read from the disk as they are stored (:class:`~sidecar.localfs.FileSource`): blocking
    chunks, raising :class:`~sidecar.localfs.Unstable` after the last when they were not the
    bytes expected."""

    def iter_sync(self) -> Iterator[bytes]: ...


class HeaderEntry:
    """What a bundle's or a point's header lists per key: written (``meta``) or deleted (``meta``
    None). Mixed into their dataclasses, which declare the fields."""

    key: str
    meta: ObjectMeta | None

    @property
    def deleted(self) -> bool:
        return self.meta is None

    @property
    def written(self) -> ObjectMeta:
        """The metadata of an entry that writes."""
        assert self.meta is not None, f"{self.key} is a deletion"
        return self.meta


@dataclass(frozen=True)
class Member:
    """One file of an archive: its key (the member's name), size, mode, mtime and bytes."""

    key: str
    size: int
    mode: int
    mtime_ns: int
    data: bytes | Streamed


def member_header(name: str, size: int, mode: int, mtime_ns: int) -> bytes:
    """The tar header blocks of a regular member (a pax header first where the name needs one)."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode & 0o7777, mtime_ns // 1_000_000_000
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")


def pad(size: int) -> bytes:
    """The zeros after a member of ``size`` bytes, to the next block."""
    return bytes(-size % BLOCK)


def _pieces(manifest_name: str, header: bytes, members: Iterable[Member]) -> Iterator[bytes]:
    yield member_header(manifest_name, len(header), 0o600, 0)
    for i in range(0, len(header), CHUNK_BYTES):
        yield header[i : i + CHUNK_BYTES]
    yield pad(len(header))
    for m in members:
        yield member_header(m.key, m.size, m.mode, m.mtime_ns)
        if isinstance(m.data, bytes):
            if len(m.data) != m.size:
                raise Unstable(m.key)
            for i in range(0, len(m.data), CHUNK_BYTES):
                yield m.data[i : i + CHUNK_BYTES]
        else:
            size = 0
            for chunk in m.data.iter_sync():
                size += len(chunk)
                if size > m.size:
                    raise Unstable(m.key)
                yield chunk
            if size != m.size:  # (a source's own check catches this too)
                raise Unstable(m.key)
        yield pad(m.size)
    yield bytes(2 * BLOCK)


def tar_chunks(manifest_name: str, header: bytes, members: Iterable[Member]) -> Iterator[bytes]:
    """The archive of ``header`` (the first member, ``manifest_name``) and ``members``, in chunks
    of at most CHUNK_BYTES (small pieces joined). Blocking: a streamed member is read here, and
    raises :class:`~sidecar.localfs.Unstable` when it is not the size or bytes expected."""
    pending: list[bytes] = []
    size = 0
    for piece in _pieces(manifest_name, header, members):
        if pending and size + len(piece) > CHUNK_BYTES:
            yield b"".join(pending)
            pending, size = [], 0
        pending.append(piece)
        size += len(piece)
    if pending:
        yield b"".join(pending)


class TarSource:
    """An archive to store as a stream (:class:`~sidecar.store.base.Source`): made by
    :meth:`measure`, which reads it once for its size and digests; every read after that yields
    the same bytes or raises :class:`~sidecar.localfs.Unstable` (a file changed), and the store
    then leaves the object as it was. ``make`` gives a fresh iterator of the archive's chunks."""

    def __init__(self, make: Callable[[], Iterator[bytes]], size: int, sha256: str, md5: bytes) -> None:
        self._make = make
        self.size, self.sha256, self.md5 = size, sha256, md5

    @staticmethod
    def digests(make: Callable[[], Iterator[bytes]]) -> tuple[int, str, bytes]:
        """Blocking: the size, sha256 (hex) and md5 of the chunks ``make()`` gives."""
        sha, md5, size = hashlib.sha256(), hashlib.md5(), 0
        for chunk in make():
            sha.update(chunk)
            md5.update(chunk)
            size += len(chunk)
        return size, sha.hexdigest(), md5.digest()

    def iter_sync(self) -> Iterator[bytes]:
        return self._make()

    async def chunks(self) -> AsyncIterator[bytes]:
        it = self.iter_sync()
        done = object()
        try:
            while (chunk := await anyio.to_thread.run_sync(next, it, done)) is not done:
                yield chunk  # type: ignore[misc]
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()


def pax_records(raw: bytes) -> dict[str, str]:
    """The records of a pax extended header (``"<len> <key>=<value>\\n"`` each)."""
    out, pos = {}, 0
    while pos < len(raw):
        space = raw.index(b" ", pos)
        length = int(raw[pos:space])
        record = raw[space + 1 : pos + length]
        if length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise ValueError("malformed pax record")
        k, _, v = record[:-1].partition(b"=")
        out[k.decode("utf-8")] = v.decode("utf-8")
        pos += length
    return out


class TarReader:
    """Reads an archive from its chunks as they arrive. ``error`` is the exception raised for
    anything malformed, cut short or not matching (one line naming ``what``: "bundle", "point"):
    an archive is read from the store, so it is checked, never trusted."""

    def __init__(self, chunks: AsyncIterator[bytes], what: str, error: type[Exception]) -> None:
        self._chunks = chunks
        # The unread bytes are self._buf[self._pos:]: a read advances the position rather than
        # copying the rest of a (megabytes) chunk, and a read that spans chunks joins its pieces
        # once, so every byte is copied at most twice whatever the members' and chunks' sizes.
        self._buf = b""
        self._pos = 0
        self._eof = False
        self.what = what
        self._error = error

    def fail(self, detail: str) -> Exception:
        """The error to raise: ``unreadable <what>: <detail>``."""
        return self._error(f"unreadable {self.what}: {detail}")

    async def _next(self) -> bytes | None:
        """The next non-empty chunk; None at the end of the archive."""
        while not self._eof:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                self._eof = True
                break
            if chunk:
                return chunk
        return None

    async def fill(self) -> bool:
        """One more chunk onto the buffer (its unread rest and the chunk joined); False at the end
        of the archive. Only for a caller that searches :attr:`buffered` (a reader of its own
        reads with :meth:`read` and :meth:`some`, which never join more than they return)."""
        chunk = await self._next()
        if chunk is None:
            return False
        self._buf = self._buf[self._pos:] + chunk if self._pos < len(self._buf) else chunk
        self._pos = 0
        return True

    def _left(self) -> int:
        return len(self._buf) - self._pos

    async def read(self, n: int) -> bytes:
        """Exactly ``n`` bytes."""
        if self._left() >= n:
            return self.take(n)
        parts = [self.take(self._left())]
        have = len(parts[0])
        while have < n:
            chunk = await self._next()
            if chunk is None:
                raise self.fail("cut short")
            self._buf, self._pos = chunk, 0
            parts.append(self.take(n - have))
            have += len(parts[-1])
        return b"".join(parts)

    async def some(self, n: int) -> bytes:
        """Between 1 and ``n`` bytes (whatever is buffered, or the next chunk)."""
        if not self._left():
            chunk = await self._next()
            if chunk is None:
                raise self.fail("cut short")
            self._buf, self._pos = chunk, 0
        return self.take(n)

    async def next_member(self) -> tuple[str, int]:
        """The name and size of the next tar member (a pax header before it applied); only
        regular files are accepted."""
        try:
            info = tarfile.TarInfo.frombuf(await self.read(BLOCK), "utf-8", "surrogateescape")
            pax: dict[str, str] = {}
            if info.type == tarfile.XHDTYPE:
                if info.size > MAX_PAX_BYTES:
                    raise self.fail("oversized pax header")
                pax = pax_records(await self.read(info.size))
                await self.read(-info.size % BLOCK)
                info = tarfile.TarInfo.frombuf(await self.read(BLOCK), "utf-8", "surrogateescape")
            if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
                raise self.fail(f"member {info.name!r} is not a regular file")
            return pax.get("path", info.name), int(pax.get("size", info.size))
        except self._error:
            raise
        except (tarfile.HeaderError, ValueError) as e:
            raise self.fail(str(e)) from None

    async def manifest(self, name: str, max_bytes: int) -> bytes:
        """The first member's bytes, which must be named ``name`` and hold at most ``max_bytes``."""
        got, size = await self.next_member()
        if got != name:
            raise self.fail("no header")
        if size > max_bytes:
            raise self.fail(f"its header is larger than {max_bytes} bytes")
        raw = await self.read(size)
        await self.read(-size % BLOCK)
        return raw

    async def body(self, key: str, size: int, sha256: str, mismatch: str,
                   mismatch_error: type[Exception] | None = None) -> AsyncIterator[bytes]:
        """The member of ``key`` (its tar header read here): its ``size`` bytes a chunk at a time,
        then the padding; raises ``error(mismatch)`` (or ``mismatch_error(mismatch)``) after the
        last chunk and the padding when they do not hash to ``sha256``: the reader then stands at
        the next member, so a caller that catches only that may read on (``verify`` names every
        bad member). Read it to the end before the next."""
        name, got = await self.next_member()
        if name != key or got != size:
            raise self.fail(f"entry {key!r} is not where its header says")
        digest = hashlib.sha256()
        async for chunk in self._span(size):
            digest.update(chunk)
            yield chunk
        await self.read(-size % BLOCK)
        if digest.hexdigest() != sha256:
            raise (mismatch_error or self._error)(mismatch)

    async def raw_body(self, size: int, sha256: str, mismatch: str) -> AsyncIterator[bytes]:
        """``size`` bytes from here, checked against ``sha256`` after the last (no tar framing)."""
        digest = hashlib.sha256()
        async for chunk in self._span(size):
            digest.update(chunk)
            yield chunk
        if digest.hexdigest() != sha256:
            raise self._error(mismatch)

    async def _span(self, size: int) -> AsyncIterator[bytes]:
        """``size`` bytes from here, a chunk at a time (unchecked)."""
        left = size
        while left:
            chunk = await self.some(min(left, CHUNK_BYTES))
            left -= len(chunk)
            yield chunk

    async def end(self, min_blocks: int = 1) -> None:
        """The end-of-archive blocks: zeros, to the end, at least ``min_blocks`` of them."""
        seen = 0
        while self._left() or await self.fill():
            rest = self.take(self._left())
            if rest.count(0) != len(rest):
                raise self.fail("bytes beyond its entries")
            seen += len(rest)
        if seen < min_blocks * BLOCK:
            raise self.fail("cut short")

    @property
    def buffered(self) -> bytes:
        return self._buf[self._pos:]

    def take(self, n: int) -> bytes:
        """The first ``n`` buffered bytes (at most), consumed."""
        start = self._pos
        self._pos = min(start + n, len(self._buf))
        if start == 0 and self._pos == len(self._buf):
            out, self._buf, self._pos = self._buf, b"", 0  # the whole chunk: no copy
            return out
        return self._buf[start:self._pos]


def load_header(raw: bytes, max_entries: int, what: str, error: type[Exception]) -> object:
    """An archive's JSON header, parsed with at most ``max_entries`` + 1 JSON objects (the header
    and its entries: bounded before the next object is built); ``ValueError`` when malformed."""
    objects = 0

    def counted(pairs: list) -> dict:
        nonlocal objects
        objects += 1
        if objects > max_entries + 1:
            raise error(f"unreadable {what}: the header names more than {max_entries} entries")
        return dict(pairs)

    try:
        return json.loads(raw, object_pairs_hook=counted)
    except RecursionError:  # nested past the parser's depth: as malformed as any other
        raise ValueError("nested too deeply") from None


async def drain(chunks: AsyncIterator[bytes]) -> None:
    """Read ``chunks`` to the end (its checks run), dropping the bytes."""
    async for _ in chunks:
        pass
