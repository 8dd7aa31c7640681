"""Keeps the benchmark harness working: a tiny run of bench/run.py. Asserts no timing."""

import json
import subprocess
import sys

from support import REPO


def test_bench_quick_runs_and_writes_results():
    r = subprocess.run([sys.executable, "bench/run.py", "--quick", "--only", "latency,burst,restore,scaling"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    written = [line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith("wrote ")]
    assert len(written) == 1, r.stdout[-2000:]
    results = json.loads((REPO / written[0]).read_text())["results"]
    figures = {x["figure"].split(" ")[0] for x in results}
    assert {"latency", "burst", "restore", "write"} <= figures
