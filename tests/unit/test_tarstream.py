"""The streamed tar reader copies each byte of an archive a bounded number of times, whatever the
sizes of its members and of the chunks it arrives in: reading a point costs O(its bytes)."""

from __future__ import annotations

import hashlib

import anyio
import pytest

from sidecar.points.format import FULL, PointEntry, PointHeader, encode_point, read_point
from sidecar.store.base import ObjectMeta


class Counted(bytes):
    """A chunk that counts the bytes copied out of it: every slice and every concatenation (the
    ways a reader of ``bytes`` copies them), into a shared tally; what it gives is Counted too, so
    a copy of a copy is counted again."""

    tally = [0]

    def __getitem__(self, index):  # type: ignore[override]
        got = bytes.__getitem__(self, index)
        if isinstance(index, slice):
            Counted.tally[0] += len(got)
            return Counted(got)
        return got

    def __add__(self, other):  # type: ignore[override]
        Counted.tally[0] += len(self) + len(other)
        return Counted(bytes.__add__(self, other))

    def __radd__(self, other):
        Counted.tally[0] += len(self) + len(other)
        return Counted(bytes(other) + bytes(self))


def _point(n: int, size: int) -> tuple[bytes, dict[str, bytes]]:
    files = {f"r/c{i % 50}/{i:05}.json": bytes([i % 251]) * size for i in range(n)}
    entries = tuple(PointEntry(k, ObjectMeta(len(v), hashlib.sha256(v).hexdigest(), 1_700_000_000 * 10**9, 0o640, 1))
                    for k, v in files.items())
    h = PointHeader(FULL, 1, 1, 1, entries)
    return encode_point(h, files), files


def _copied(blob: bytes, piece: int) -> tuple[int, dict[str, bytes]]:
    async def chunks():
        for i in range(0, len(blob), piece):
            yield Counted(blob[i : i + piece])

    Counted.tally[0] = 0
    _, got = anyio.run(read_point, chunks())
    return Counted.tally[0], got


@pytest.mark.parametrize(("n", "size", "piece"), [
    (2000, 100, 4 * 1024 * 1024),  # many small members in one large chunk: no re-slicing per header
    (2000, 100, 1024),  # a header of ~250 KiB in 1 KiB chunks: a read across chunks joins once
    (20, 300_000, 4096),  # large members in small chunks
])
def test_reading_a_point_copies_each_byte_a_bounded_number_of_times(n, size, piece):
    blob, files = _point(n, size)
    copied, got = _copied(blob, piece)
    assert got == files
    # each byte is sliced out of its chunk at most once (the joins of a read across chunks give
    # exactly the bytes read, once): within 2x of the archive's size, never members x chunk
    assert copied <= 2 * len(blob), (copied, len(blob))
