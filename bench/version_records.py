"""What raising the roots' lineage records before each upload costs a burst: one ``sync`` in
process on the memory store (tests/memstore.py), 1,000 x 16 KiB files renamed into a root at once,
until all are stored; the process CPU and wall time of the whole session and how many times the
records were rewritten (sidecar.restorefs.raise_lineage). Run it from two checkouts to compare
(``--tree``); nothing here asserts a time.

    .venv/bin/python bench/version_records.py [--tree DIR] [--files 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent), help="the checkout measured")
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    sys.path[:0] = [a.tree, str(here), str(here / "tests")]
    import anyio

    import sidecar.daemon as daemon
    from support import write_atomic
    from tests.inprocess import InProcess, run_sync, settings_for
    from tests.memstore import MemorySpace

    raises: list[int] = []
    real = getattr(daemon, "raise_lineage", None)
    if real is not None:  # a checkout that groups the raises; older ones rewrite per upload
        def counting(roots, lineage):
            raises.append(1)
            return real(roots, lineage)
        daemon.raise_lineage = counting

    async def once(tmp: Path) -> tuple[float, float, int]:
        work = tmp / "w"
        (work / ".checkpoints").mkdir(parents=True)
        write_atomic(work / ".checkpoints" / "first.json", b"{}")  # a recorded root from the start
        settings, roots = settings_for(work, "unused", restore_point_interval=0, reconcile_interval=0)
        store = MemorySpace().store("")
        await store.open()

        async def host(_: InProcess) -> None:
            staging = tmp / "staging"
            for i in range(a.files):
                write_atomic(staging / f"{i}.json", b"x" * 16384)
            staging.rename(work / ".checkpoints" / "burst")
            with anyio.fail_after(300):
                while sum([1 async for _ in store.list(".checkpoints/burst/")]) < a.files:
                    await anyio.sleep(0.05)

        raises.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        assert await run_sync(InProcess(settings, roots, store), host) == 0
        return time.perf_counter() - t0, time.process_time() - c0, len(raises)

    walls, cpus = [], []
    for r in range(a.rounds):
        with tempfile.TemporaryDirectory(prefix="version-records-") as d:
            wall, cpu, n = anyio.run(once, Path(d))
        walls.append(wall)
        cpus.append(cpu)
        print(f"round {r + 1}: wall {wall:.2f} s, cpu {cpu:.2f} s, records rewritten {n if real else 'per upload'}")
    print(f"{a.tree}: median wall {statistics.median(walls):.2f} s, cpu {statistics.median(cpus):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
