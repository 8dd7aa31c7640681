"""Restore points: their names and format; the pure plans over them are :mod:`sidecar.points.plan`'s.
No I/O but the streaming helpers' reads of the files they are handed (blocking, in
:func:`point_chunks`) and the chunks a :class:`PointReader` awaits.

A point is one tar archive (:mod:`sidecar.tarstream`, the snapshot bundles' format) under
``.sidecar/points/`` in the namespace (the contract: docs/RESTORE.md, "Restore points"):

    .sidecar/points/<seq>-full.tar             every mirrored file at one moment
    .sidecar/points/<seq>-incr-<base>.tar      the files changed and deleted since the point
                                               before it, in the chain of full point <base>

``seq`` and ``base`` are 19-digit zero-padded (names sort by seq); ``seq`` is the writer's version
for the point. Its first member, ``.sidecar-point.json``, is the header (:class:`PointHeader`):
``{"format": "checkpoint-sidecar-point", "version": 1, "kind", "seq", "base", "prev", "entries"}``,
each entry a file (key, size, sha256, mtime_ns, mode, version: the per-file object the bytes were
stored as) or, in an incremental, a deletion (``{"key", "deleted": true}``); then one member per
file, in the header's order, named by its key. A point's time is its object's store time
(``ObjectInfo.modified``), never a local clock.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Mapping

from sidecar.store.base import OWN_NAMESPACE, ObjectMeta
from sidecar.tarstream import (
    MAX_ENTRIES,
    MAX_HEADER_BYTES,
    HeaderEntry,
    Member,
    Streamed,
    TarReader,
    TarSource,
    drain,
    load_header,
    tar_chunks,
)

POINT_DIR = f"{OWN_NAMESPACE}/points"
#: The first member of a point.
POINT_MANIFEST = ".sidecar-point.json"
FORMAT = "checkpoint-sidecar-point"
FORMAT_VERSION = 1
FULL, INCR = "full", "incr"
#: Header bounds: those of the snapshot bundles (a header is read and parsed whole).
MAX_POINT_ENTRIES = MAX_ENTRIES
MAX_POINT_HEADER_BYTES = MAX_HEADER_BYTES
_SEQ_DIGITS = 19
_NAME = re.compile(r"(\d{19})-(?:(full)|(incr)-(\d{19}))\.tar")


class PointError(ValueError):
    """A point that cannot be used (malformed, cut short, not matching its name or its sha256s)."""


class EntryMismatch(PointError):
    """A point's member whose bytes do not hash to its entry's sha256. Raised once the member and
    its padding are read: the reader stands at the next member, and may be read on."""


# -- names ------------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class PointName:
    """What a point's key says: its seq, kind (``"full"`` or ``"incr"``) and base (the seq of its
    chain's full point; == seq for a full). Ordered by seq."""

    seq: int
    kind: str = field(compare=False)
    base: int = field(compare=False)

    @property
    def key(self) -> str:
        return point_key(self.kind, self.seq, self.base)

    @property
    def full(self) -> bool:
        return self.kind == FULL


def point_key(kind: str, seq: int, base: int) -> str:
    """The store key of a point (relative to the namespace). A full point's ``base`` is its seq."""
    if kind not in (FULL, INCR) or not 0 <= base <= seq < 10**_SEQ_DIGITS or (kind == FULL and base != seq):
        raise ValueError(f"no point is named {kind} {seq} of base {base}")
    if kind == FULL:
        return f"{POINT_DIR}/{seq:019d}-full.tar"
    if base == seq:
        raise ValueError(f"an incremental point {seq} cannot be its own base")
    return f"{POINT_DIR}/{seq:019d}-incr-{base:019d}.tar"


def parse_point_key(key: str) -> PointName | None:
    """The name a point's store key gives; None for any other key (never used, never deleted)."""
    prefix = POINT_DIR + "/"
    if not key.startswith(prefix):
        return None
    m = _NAME.fullmatch(key[len(prefix):])
    if m is None:
        return None
    seq = int(m.group(1))
    if m.group(2):
        return PointName(seq, FULL, seq)
    base = int(m.group(4))
    return PointName(seq, INCR, base) if base < seq else None


# -- the header -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PointEntry(HeaderEntry):
    """A file of a point (``meta``: size, sha256, mtime_ns, mode and the per-file object's
    ``version``) or, in an incremental point, a deletion (``meta`` None)."""

    key: str
    meta: ObjectMeta | None


@dataclass(frozen=True)
class PointHeader:
    """A point's header: kind, seq, base (its full point's seq), prev (the point it follows; ==
    seq for a full) and entries (keys unique; a full has no deletions)."""

    kind: str
    seq: int
    base: int
    prev: int
    entries: tuple[PointEntry, ...]

    @property
    def name(self) -> PointName:
        return PointName(self.seq, self.kind, self.base)

    def matches(self, name: PointName) -> bool:
        """Whether the header says what its object's name says."""
        return (self.kind, self.seq, self.base) == (name.kind, name.seq, name.base)

    def files(self) -> list[PointEntry]:
        return [e for e in self.entries if e.meta is not None]

    def bytes_of_files(self) -> int:
        return sum(e.meta.size for e in self.entries if e.meta is not None)


def _entry_json(e: PointEntry) -> dict:
    if e.meta is None:
        return {"key": e.key, "deleted": True}
    m = e.meta
    return {"key": e.key, "size": m.size, "sha256": m.sha256, "mtime_ns": m.mtime_ns, "mode": m.mode,
            "version": m.version}


def encode_header(h: PointHeader) -> bytes:
    """The header member's bytes (compact JSON)."""
    return json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "kind": h.kind, "seq": h.seq, "base": h.base,
                       "prev": h.prev, "entries": [_entry_json(e) for e in h.entries]},
                      separators=(",", ":")).encode()


def fits(h: PointHeader) -> bool:
    """Whether a reader accepts the header: at most :data:`MAX_POINT_ENTRIES` entries and
    :data:`MAX_POINT_HEADER_BYTES` bytes. A tree larger than that gets no point."""
    return len(h.entries) <= MAX_POINT_ENTRIES and len(encode_header(h)) <= MAX_POINT_HEADER_BYTES


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(raw: bytes) -> PointHeader:
    """The header of a point's first member; :class:`PointError` for anything malformed."""
    try:
        h = load_header(raw, MAX_POINT_ENTRIES, "point", PointError)
        if not isinstance(h, dict) or h.get("format") != FORMAT:
            raise PointError("unreadable point: not a point header")
        if h.get("version") != FORMAT_VERSION:
            raise PointError(f"unknown point version {h.get('version')!r}")
        kind, seq, base, prev, raw_entries = h["kind"], h["seq"], h["base"], h["prev"], h["entries"]
        if kind not in (FULL, INCR) or not all(_is_int(v) and v >= 0 for v in (seq, base, prev)) \
                or not isinstance(raw_entries, list):
            raise PointError("unreadable point: malformed header")
        if (kind == FULL and not seq == base == prev) or (kind == INCR and not base <= prev < seq):
            raise PointError("unreadable point: its seq, base and prev do not agree")
        entries, seen = [], set()
        for e in raw_entries:
            if not isinstance(e, dict) or not isinstance(e.get("key"), str) or e["key"] in seen:
                raise PointError("unreadable point: malformed entry")
            seen.add(e["key"])
            if e.get("deleted") is True:
                if kind == FULL:
                    raise PointError(f"unreadable point: a full point deletes {e['key']!r}")
                entries.append(PointEntry(e["key"], None))
                continue
            size, sha, mtime, mode, version = e["size"], e["sha256"], e["mtime_ns"], e["mode"], e["version"]
            if not (_is_int(size) and size >= 0 and _is_int(mtime) and _is_int(mode) and _is_int(version)
                    and isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
                raise PointError(f"unreadable point: entry {e['key']!r} is malformed")
            entries.append(PointEntry(e["key"], ObjectMeta(size, sha, mtime, mode & 0o7777, version)))
        return PointHeader(kind, seq, base, prev, tuple(entries))
    except PointError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise PointError(f"unreadable point: {e}") from None


# -- the stream -------------------------------------------------------------------------------
def point_chunks(header: PointHeader, data: Mapping[str, bytes | Streamed]) -> Iterator[bytes]:
    """The point of ``header``, its files' bytes from ``data`` (by key: bytes, or a source read
    here, blocking, that raises :class:`~sidecar.localfs.Unstable` after its last chunk when its
    bytes are not the entry's), in chunks of at most CHUNK_BYTES."""
    members = (Member(e.key, e.written.size, e.written.mode, e.written.mtime_ns, data[e.key]) for e in header.files())
    return tar_chunks(POINT_MANIFEST, encode_header(header), members)


def encode_point(header: PointHeader, data: Mapping[str, bytes]) -> bytes:
    """A point over bytes in hand (small points and tests)."""
    return b"".join(point_chunks(header, data))


def point_source(header: PointHeader, data: Mapping[str, bytes | Streamed]) -> TarSource:
    """The point as a :class:`~sidecar.store.base.Source` for a streamed put. Blocking: reads the
    files once for the point's size and digests (every later read checks them again)."""

    def make() -> Iterator[bytes]:
        return point_chunks(header, data)

    return TarSource(make, *TarSource.digests(make))


class PointReader:
    """Reads a point from its chunks as they arrive: :meth:`header` first (parsed, bounded), then
    :meth:`files` gives each file entry with its bytes, a chunk at a time, in the header's order;
    each member's bytes are hashed as they stream and a mismatch raises :class:`EntryMismatch` (a
    :class:`PointError`) after its last chunk: a caller that catches it may read on. Anything
    malformed or cut short is a :class:`PointError`."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._tar = TarReader(chunks, "point", PointError)
        self._header: PointHeader | None = None

    async def header(self, name: PointName | None = None) -> PointHeader:
        """The header; with ``name`` (what the object's key says), a header that does not match
        it is a :class:`PointError`."""
        if self._header is None:
            self._header = parse_header(await self._tar.manifest(POINT_MANIFEST, MAX_POINT_HEADER_BYTES))
        if name is not None and not self._header.matches(name):
            raise PointError(f"unreadable point: {name.key!r} holds the header of another point")
        return self._header

    async def files(self) -> AsyncIterator[tuple[PointEntry, AsyncIterator[bytes]]]:
        """Each file entry with its bytes (read them, or not: the rest is skipped, still
        checked). Ends after checking the archive ends where its header says."""
        h = await self.header()
        for e in h.files():
            body = self._tar.body(e.key, e.written.size, e.written.sha256,
                                  f"point {h.seq} entry {e.key!r} does not match its sha256", EntryMismatch)
            yield e, body
            await drain(body)
        await self._tar.end(min_blocks=2)  # as written: a point cut short by a block is refused


async def read_point(chunks: AsyncIterator[bytes]) -> tuple[PointHeader, dict[str, bytes]]:
    """A whole point with its files' bytes held: small points and tests only."""
    reader = PointReader(chunks)
    h = await reader.header()
    got: dict[str, bytes] = {}
    async for e, body in reader.files():
        got[e.key] = b"".join([c async for c in body])
    return h, got
