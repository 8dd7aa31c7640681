"""How much AzureBlobStore.put adds to a raw SDK upload of the same 4 KiB, against Azurite.

    .venv/bin/python bench/store_overhead.py [--iterations 400] [--size 4096] [--profile]

Starts its own Azurite (tests/azurite.py), then times, interleaved in one run and alternating
which goes first: the floor, a plain async ``BlobClient.upload_blob(data, overwrite=True)`` on a
client made once, and ``AzureBlobStore.put`` of the same bytes in its steady state (updates of a
known blob, passed as ``expected``: one conditional PUT with Content-MD5 and metadata). Prints p50/p99 of both and the
overhead, and writes bench/out/store_overhead.json. Timings are informational; no test asserts them.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from azure.storage.blob.aio import BlobServiceClient  # noqa: E402

from sidecar.store import make_store  # noqa: E402
from sidecar.store.base import ObjectInfo, ObjectMeta  # noqa: E402
from tests.azurite import Azurite  # noqa: E402

OUT = os.path.join(REPO, "bench", "out", "store_overhead.json")


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def summary(samples: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples]
    return {
        "p50_ms": round(pct(ms, 50), 4),
        "p90_ms": round(pct(ms, 90), 4),
        "p99_ms": round(pct(ms, 99), 4),
        "mean_ms": round(statistics.fmean(ms), 4),
        "min_ms": round(min(ms), 4),
    }


async def run(url: str, conn: str, iterations: int, size: int, warmup: int, profile: bool) -> dict:
    data = os.urandom(size)
    container = "bench"
    raw_service = BlobServiceClient.from_connection_string(conn)
    store = make_store(f"{url}/{container}", "store", env={"AZURE_STORAGE_CONNECTION_STRING": conn})
    await store.open()  # creates the container
    raw_blob = raw_service.get_container_client(container).get_blob_client("raw/ckpt.json")
    key = "root/ckpt.json"
    # The caller computes sha256 while it reads the file; ObjectMeta is not part of put's cost.
    metas = [ObjectMeta.of(data, 1_000 + i, 0o600) for i in range(warmup + iterations)]

    async def raw_once() -> float:
        t = time.perf_counter()
        await raw_blob.upload_blob(data, overwrite=True)
        return time.perf_counter() - t

    last: list[ObjectInfo | None] = [None]  # what the caller knows the store holds (StoreState's job)

    async def put_once(i: int) -> float:
        t = time.perf_counter()
        info = await store.put(key, data, metas[i], expected=last[0])
        elapsed = time.perf_counter() - t
        assert info.mtime_ns == metas[i].mtime_ns
        last[0] = info
        return elapsed

    for i in range(warmup):
        await raw_once()
        await put_once(i)

    raw: list[float] = []
    put: list[float] = []
    profiler = cProfile.Profile() if profile else None
    for n in range(iterations):
        i = warmup + n
        if n % 2:
            raw.append(await raw_once())
            put.append(await put_once(i))
        else:
            if profiler:
                profiler.enable()
            put.append(await put_once(i))
            if profiler:
                profiler.disable()
            raw.append(await raw_once())
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)

    await store.aclose()
    await raw_service.close()
    r, p = summary(raw), summary(put)
    return {
        "what": f"AzureBlobStore.put vs raw BlobClient.upload_blob, {size} bytes, Azurite, interleaved",
        "iterations": iterations,
        "size_bytes": size,
        "raw_upload_blob": r,
        "store_put": p,
        "p50_ratio": round(p["p50_ms"] / r["p50_ms"], 4),
        "p50_overhead_pct": round((p["p50_ms"] / r["p50_ms"] - 1) * 100, 2),
        "p50_overhead_ms": round(p["p50_ms"] - r["p50_ms"], 4),
        "p99_ratio": round(p["p99_ms"] / r["p99_ms"], 4),
        "target": "p50 overhead < 10 %",
        "python": platform.python_version(),
        "unix_time": int(time.time()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--profile", action="store_true", help="cProfile half of the put calls")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="azurite-bench-") as location:
        with Azurite(location) as server:
            result = asyncio.run(run(server.url, server.connection_string, args.iterations, args.size,
                                     args.warmup, args.profile))
    r, p = result["raw_upload_blob"], result["store_put"]
    print(f"{'':22}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for name, s in (("raw upload_blob", r), ("AzureBlobStore.put", p)):
        print(f"{name:22}{s['p50_ms']:>10.3f}{s['p90_ms']:>10.3f}{s['p99_ms']:>10.3f}{s['mean_ms']:>10.3f}")
    print(f"put/raw at p50: x{result['p50_ratio']:.3f} ({result['p50_overhead_pct']:+.1f} %, "
          f"{result['p50_overhead_ms']:+.3f} ms); at p99: x{result['p99_ratio']:.3f}; target: < +10 %")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
