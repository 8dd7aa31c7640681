"""What restore points cost: stored bytes and store requests per hour for a namespace of
``--namespace-mib`` MiB in which the host changes ``--changed-kib`` KiB a second, against Azurite.

    .venv/bin/python bench/points_cost.py [--namespace-mib 100] [--changed-kib 1] [--hours 1]

Starts its own Azurite (tests/azurite.py) behind the counting proxy of tests/proxy.py and drives
the real point writer (sidecar/pointwriter.py) through the real Writer, Fence and AzureBlobStore,
on a compressed schedule: an hour of the host is simulated in seconds. The fence runs on a
simulated clock too (a second per simulated second), so its proofs of ownership cost what they
would in real time. The tree is ``--namespace-mib`` files of 1 MiB plus 60 small files of
``--changed-kib`` KiB; every simulated second the host rewrites one small file (the per-file
object is put through the same writer, as the uploader would) and every
SIDECAR_RESTORE_POINT_INTERVAL (60 s) the point writer runs once. Bytes are those the store was
of the point objects stored (their sizes: a point is stored as written, uncompressed); requests are every HTTP
request of the point writer (its puts, block uploads, listings, deletes, and the marker reads of
its proofs), apart from those of the per-file puts. The first full point is reported apart: it
happens once per chain, and a chain lasts up to SIDECAR_RESTORE_POINT_FULL_INTERVAL (a day).

Prints the figures and writes bench/out/points.json. Counts, not timings.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from tests.azurite import Azurite, connection_string, unique_container  # noqa: E402
from tests.proxy import Proxy  # noqa: E402

OUT = REPO / "bench" / "out" / "points.json"
POINTS = ".sidecar/points/"
MARKER = ".sidecar/owner"
MIB = 1 << 20


class Clock:
    """The simulated clock of the fence (seconds)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def measure(url: str, root_dir: Path, proxy: Proxy, *, namespace_mib: int, changed_kib: float,
                  seconds: int, interval: int) -> dict:
    from sidecar.fence import Fence
    from sidecar.known import StoreState
    from sidecar.paths import Root
    from sidecar.points.plan import Retention
    from sidecar.points.writer import PointWriter
    from sidecar.store import make_store
    from sidecar.store.base import ObjectMeta
    from sidecar.writer import Writer

    env = {"AZURE_STORAGE_CONNECTION_STRING": connection_string(proxy.via(url.rsplit("/", 1)[0]))}
    store = make_store(proxy.via(url), env=env)
    await store.open()
    clock = Clock()

    async def sleep(s: float) -> None:
        clock.now += s

    fence = Fence(store, window=2.0, margin=0.0, clock=clock, sleep=sleep)
    writer = Writer(store, fence)
    await writer.claim()
    root = Root(".checkpoints", str(root_dir))
    known = StoreState()

    async def put(rel: str, data: bytes) -> None:
        path = root_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        key = f".checkpoints/{rel}"
        known.stored(key, await writer.put(key, data, ObjectMeta.of(data, path.stat().st_mtime_ns, 0o644)))

    for i in range(namespace_mib):
        await put(f"big/{i:04d}.bin", hashlib.sha256(str(i).encode()).digest() * (MIB // 32))
    small = int(changed_kib * 1024)
    for i in range(60):
        await put(f"small/{i:02d}.json", os.urandom(small))

    points = PointWriter(writer, [root], known, interval=float(interval), full_interval=86400.0,
                         retention=Retention(), idle=lambda: True, wait_idle=_nothing)

    def mark() -> int:
        return len(proxy.records)

    start = mark()
    first = await points.write_point()  # the chain's full point
    full_records = proxy.records[start:]
    changed = 0
    stored = 0
    kinds: Counter[str] = Counter()
    point_records = []
    for s in range(1, seconds + 1):
        clock.now += 1.0
        data = os.urandom(small)
        at = mark()
        await put(f"small/{s % 60:02d}.json", data)  # the uploader's per-file put: not the points'
        del proxy.records[at:]
        changed += len(data)
        if s % interval == 0:
            at = mark()
            w = await points.write_point()
            point_records += proxy.records[at:]
            if w is not None:
                kinds[w.name.kind] += 1
                stored += w.size
    await store.aclose()

    def by_kind(records) -> dict[str, int]:
        out: Counter[str] = Counter()
        for r in records:
            what = "list" if "comp=list" in (r.query or "") else ("marker" if r.blob == MARKER else
                                                                  "point" if r.blob.startswith(POINTS) else "other")
            out[f"{r.method} {what}"] += 1
        return dict(out)

    hours = seconds / 3600
    full_bytes = first.size if first is not None else 0
    incr_bytes = stored
    return {
        "namespace_mib": namespace_mib, "changed_bytes_per_second": small, "simulated_seconds": seconds,
        "interval": interval, "points": dict(kinds), "first_full": {"bytes": full_bytes, "requests": len(full_records),
                                                                    "by_kind": by_kind(full_records),
                                                                    "object_bytes": first.size if first else None},
        "host_changed_bytes_per_hour": round(changed / hours),
        "point_bytes_per_hour": round(incr_bytes / hours),
        "point_requests_per_hour": round(len(point_records) / hours),
        "point_requests_by_kind_per_hour": {k: round(v / hours) for k, v in by_kind(point_records).items()},
        "ratio_to_changed": round(incr_bytes / changed, 2),
        "with_one_full_a_day_bytes_per_hour": round(incr_bytes / hours + full_bytes / 24),
        "target_bytes_per_hour": round(3 * changed / hours + full_bytes / 24),
    }


async def _nothing() -> None:
    return None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--namespace-mib", type=int, default=100)
    ap.add_argument("--changed-kib", type=float, default=1.0)
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--interval", type=int, default=60, help="SIDECAR_RESTORE_POINT_INTERVAL, seconds")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="points-bench-") as d:
        az = Azurite(location=str(Path(d) / "azurite")).start()
        proxy = Proxy(az.host, az.port).start()
        try:
            url = f"{az.url}/{unique_container('points')}"
            result = asyncio.run(measure(url, Path(d) / "disk" / ".checkpoints", proxy,
                                         namespace_mib=args.namespace_mib, changed_kib=args.changed_kib,
                                         seconds=round(args.hours * 3600), interval=args.interval))
        finally:
            proxy.stop()
            az.stop()
    r = result
    print(f"namespace {r['namespace_mib']} MiB, {r['changed_bytes_per_second']} B changed a second, "
          f"a point at most every {r['interval']} s, {r['simulated_seconds']} s simulated: points {r['points']}")
    print(f"  host changed:           {r['host_changed_bytes_per_hour'] / MIB:8.2f} MiB/h")
    print(f"  points stored:          {r['point_bytes_per_hour'] / MIB:8.2f} MiB/h ({r['ratio_to_changed']}x the "
          f"changed bytes), {r['point_requests_per_hour']} requests/h {r['point_requests_by_kind_per_hour']}")
    print(f"  the full point:         {r['first_full']['bytes'] / MIB:8.2f} MiB in {r['first_full']['requests']} requests "
          f"(once per chain: at most a day)")
    print(f"  with one full a day:    {r['with_one_full_a_day_bytes_per_hour'] / MIB:8.2f} MiB/h; target "
          f"<= {r['target_bytes_per_hour'] / MIB:.2f} MiB/h (3x changed + a full a day)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"results": [result]}, indent=1))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
