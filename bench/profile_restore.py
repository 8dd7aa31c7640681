"""Where a restore from a restore point spends its time: seeds a fresh Azurite as a session leaves
it (bench/run.py's seed_with_points), then profiles ``restore`` from the checkout.

    .venv/bin/python bench/profile_restore.py --files 2000 --size 4096 --py-spy /path/to/py-spy
    .venv/bin/python bench/profile_restore.py --files 1000 --size 102400          # cProfile

With ``--py-spy`` the restore runs under ``py-spy record --format raw`` (sampled, busy frames
only) and the summary counts, per function, the samples whose stack holds it; without, under
cProfile (cumulative time of the top functions). Also prints the restore's plain wall time (median
of ``--rounds``), unprofiled. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import collections
import cProfile  # noqa: F401  (run by -m below)
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(REPO / "tests")]

import run as bench  # noqa: E402  (bench/run.py)
from credentials import Target  # noqa: E402


def summarize_raw(path: Path, top: int) -> None:
    """py-spy's raw (collapsed) stacks: per function, the share of samples whose stack holds it."""
    holding: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        names = {frame.split(" (")[0] + " (" + frame.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1]
                 for frame in stack.split(";")}
        for name in names:
            holding[name] += n
    print(f"{total} samples")
    for name, n in holding.most_common(top):
        print(f"  {100 * n / total:5.1f} %  {name}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--credential", choices=("key", "identity"), default="key")
    ap.add_argument("--py-spy", dest="pyspy", default="")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--against", default="",
                    help="another checkout (e.g. `git archive BASE sidecar | tar -x -C DIR`): its restores are "
                         "interleaved with this one's on the same store, and both medians printed")
    args = ap.parse_args()
    bench.SIDECAR_PY = sys.executable
    with tempfile.TemporaryDirectory(prefix="sidecar-profile-") as d:
        tmp = Path(d)
        checkout = ["-m", "sidecar"]
        env_extra = {"PYTHONPATH": str(REPO)}  # bytecode written (a checkout under PYTHONDONTWRITEBYTECODE has none)
        bench.sidecar_cmd = lambda: [sys.executable, *checkout]  # the checkout, not an installed copy
        with Target(args.credential, tmp / "azurite", tmp / "pki") as t:
            env = {k: v for k, v in {**t.sidecar_env(), **env_extra}.items() if k != "PYTHONDONTWRITEBYTECODE"}
            t.sidecar_env = lambda: env  # type: ignore[method-assign]
            name = "profiled"
            bench.seed_with_points(t, tmp, name, args.files, args.size)
            restore = ["restore", "--store", f"{t.url}/{name}", "--log-level", "warning"]
            trees = {"this checkout": str(REPO), **({"against": args.against} if args.against else {})}
            walls: dict[str, list[float]] = {label: [] for label in trees}
            for r in range(args.rounds + 1):  # interleaved, who goes first alternating; round 0 warms
                for label, tree in (list(trees.items()) if r % 2 else list(trees.items())[::-1]):
                    work = tmp / f"plain{r}-{label.split()[0]}"
                    work.mkdir()
                    os.sync()
                    t0 = time.perf_counter()
                    subprocess.run([sys.executable, *checkout, *restore], cwd=work, env={**env, "PYTHONPATH": tree},
                                   check=True)
                    if r:
                        walls[label].append(time.perf_counter() - t0)
            for label, w in walls.items():
                print(f"restore {args.files} x {args.size} B, {label}: median {statistics.median(w):.3f} s "
                      f"({', '.join(f'{x:.2f}' for x in w)})")
            work = tmp / "profiled"
            work.mkdir()
            os.sync()
            if args.pyspy:
                raw = tmp / "raw.txt"
                subprocess.run([args.pyspy, "record", "--format", "raw", "--rate", "500", "-o", str(raw),
                                "--", sys.executable, *checkout, *restore], cwd=work, env=env, check=True,
                               capture_output=True)
                summarize_raw(raw, args.top)
            else:
                prof = tmp / "restore.prof"
                subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), *checkout, *restore],
                               cwd=work, env=env, check=True)
                import pstats
                pstats.Stats(str(prof)).sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
