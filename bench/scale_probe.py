"""Scaling probe: write -> durable p50 of 50 writes right at ``ready`` and again after 15 s.

    python bench/scale_probe.py /tmp/probe-dir 100000   # then 1000, for the reference

Tells the start-up cost of a large store (the first write's walk of the store) from a per-write
cost that grows with the tree. Seeds like ``bench/run.py --only scaling``.
"""
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as B  # noqa: E402  (bench/run.py)

tmp, n = Path(sys.argv[1]), int(sys.argv[2])
work, store = tmp / "w", tmp / "s"
B.seed_scaling_tree(work, store, n)
sc = B.SidecarProc(["sync", "--store", str(store), "--log-level", "debug"], work, B.plain_env())
try:
    sc.wait("ready", timeout=600)
    for phase in ("at ready", "after 15 s"):
        if phase != "at ready":
            time.sleep(15)
        lat = []
        for i in range(50):
            key = f"u0/c0/{phase[0]}-{i}.json"
            t0 = time.perf_counter()
            B.write_atomic(work / ".checkpoints" / key, os.urandom(4096))
            lat.append(sc.wait("uploaded", f".checkpoints/{key}") - t0)
        print(n, phase, "p50 ms", round(B.pct(lat, 50) * 1e3, 2), flush=True)
finally:
    sc.stop()
shutil.rmtree(tmp)
