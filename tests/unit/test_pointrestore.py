"""The restore's size check of a point (sidecar.pointrestore.least_size) against the writer's encoder."""

from __future__ import annotations

import hashlib
import os

from sidecar.pointrestore import least_size
from sidecar.points import PointEntry, PointHeader, encode_point
from sidecar.store.base import ObjectMeta

KEYS = [".checkpoints/a.json", ".checkpoints/" + "d/" * 60 + "long.json", ".checkpoints/naïve/é.json",
        ".checkpoints/x" * 8, ".checkpoints/empty", ".checkpoints/" + "n" * 87]


def point(sizes: list[int], mtime_ns: int = 1_700_000_000_000_000_000) -> tuple[PointHeader, bytes]:
    data = {k: os.urandom(n) for k, n in zip(KEYS, sizes, strict=True)}
    entries = tuple(PointEntry(k, ObjectMeta(len(b), hashlib.sha256(b).hexdigest(), mtime_ns, 0o640, 7))
                    for k, b in data.items())
    header = PointHeader("full", 9, 9, 9, entries)
    return header, encode_point(header, data)


def test_the_least_size_of_a_whole_point_is_never_above_its_real_size_and_catches_a_cut():
    for sizes in ([0, 1, 511, 512, 513, 70_000], [5000] * 6, [0] * 6):
        for mtime_ns in (1_700_000_000_000_000_000, -5, 2**62):
            header, blob = point(sizes, mtime_ns)
            least = least_size(header)
            assert least <= len(blob) <= least + 512  # the encoder writes one end block more than needed
            assert least > len(blob) - 1024 - 1  # any cut into the last member or its padding is found
