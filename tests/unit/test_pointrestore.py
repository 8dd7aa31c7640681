"""The restore's size check of a point (sidecar.restore.points.least_size) against the writer's encoder."""

from __future__ import annotations

import hashlib
import os

from sidecar.points.format import PointEntry, PointHeader, encode_point
from sidecar.restore.points import least_size
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


def test_small_files_are_written_in_bounded_batches_with_each_outcome(tmp_path, monkeypatch):
    """A point's small files go to worker threads a batch at a time: at most WRITE_BATCHES
    batches in flight (the next add waits: the bytes held stay bounded), each file placed with
    its outcome, a refused target reported, not raised."""
    import anyio

    from sidecar.paths import Root
    from sidecar.restore import place
    from sidecar.restore.place import BATCH_FILES, WRITE_BATCHES, BatchWriter, Small
    from sidecar.store.base import ObjectInfo

    root = Root("r", str(tmp_path / "r"))
    (tmp_path / "r" / "dir").mkdir(parents=True)  # "r/dir" is a directory on disk: refused as a target
    gate, entered = anyio.Event(), []
    real = place.write_batch

    def held(batch):
        entered.append(len(batch))
        anyio.from_thread.run(gate.wait)
        return real(batch)

    monkeypatch.setattr(place, "write_batch", held)
    keys = [f"r/f{i}" for i in range(BATCH_FILES * WRITE_BATCHES)] + ["r/dir", "r/last"]
    outcomes: dict[str, object] = {}

    async def main():
        async with anyio.create_task_group() as tg:
            writer = BatchWriter(tg, lambda s, o: outcomes.__setitem__(s.info.key, o))
            for k in keys[: BATCH_FILES * WRITE_BATCHES]:
                await writer.add(Small(root, k.split("/")[1:], ObjectInfo(k, 2, None, 10**18, 0o640), b"ok"))
            with anyio.fail_after(60):  # a poll with a deadline: every slot taken, no file written yet
                while len(entered) < WRITE_BATCHES:
                    await anyio.sleep(0.01)
            blocked = anyio.Event()

            async def one_more():
                blocked.set()
                for k in keys[-2:]:
                    await writer.add(Small(root, k.split("/")[1:], ObjectInfo(k, 2, None, 10**18, 0o640), b"ok"))
                await writer.flush()

            tg.start_soon(one_more)
            await blocked.wait()
            assert not outcomes and len(entered) == WRITE_BATCHES  # nothing beyond the bound was handed over
            gate.set()

    anyio.run(main)
    assert entered == [BATCH_FILES] * WRITE_BATCHES + [2]
    assert {k for k, o in outcomes.items() if o is None} == set(keys) - {"r/dir"}
    assert type(outcomes["r/dir"]).__name__ == "UnsafeTarget"
    assert (tmp_path / "r" / "f0").read_bytes() == b"ok" and (tmp_path / "r" / "dir").is_dir()
