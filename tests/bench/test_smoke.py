"""Keeps the benchmark harness working: a tiny run of bench/run.py. Asserts no timing."""

import json
import subprocess
import sys

import pytest

from support import REPO

pytestmark = pytest.mark.slow  # whole benchmark runs: not in the fast suite


@pytest.mark.nightly  # a whole benchmark run
def test_bench_quick_runs_and_writes_results():
    r = subprocess.run([sys.executable, "bench/run.py", "--quick", "--only", "latency,burst,restore,scaling"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    written = [line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith("wrote ")]
    assert len(written) == 1, r.stdout[-2000:]
    results = json.loads((REPO / written[0]).read_text())["results"]
    figures = {x["figure"].split(" ")[0] for x in results}
    assert {"latency", "burst", "restore", "write"} <= figures


@pytest.mark.nightly  # a benchmark run with fixed pauses; the rules: unit/test_writer.py, test_heartbeat_idle.py
def test_requests_bench_counts_one_write_per_sparse_checkpoint(tmp_path):
    """bench/request_counts.py against its own Azurite: sparse checkpoints cost one write each (the
    proof of ownership is a marker read), idling costs none, and the heartbeat writes the marker."""
    out = tmp_path / "requests.json"
    r = subprocess.run([sys.executable, "bench/request_counts.py", "--checkpoints", "3", "--gap", "2.5", "--idle", "5",
                        "--heartbeat", "2", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["checkpoint_requests"].get("PUT marker", 0) == 0, result["checkpoint_requests"]
    assert result["checkpoint_requests"]["PUT file"] == 3
    assert result["write_ops_per_checkpoint"] <= 1.1
    assert result["idle_requests"] == {}
    heartbeats = result["idle_requests_with_that_heartbeat"]
    assert heartbeats.get("PUT marker", 0) >= 1 and set(heartbeats) <= {"PUT marker", "GET marker"}, heartbeats


def test_startpath_bench_reports_each_command_imports():
    """bench/startpath.py: every command's -X importtime table, the SDK among the restore's."""
    r = subprocess.run([sys.executable, "bench/startpath.py", "--credential", "key", "--rounds", "1", "--top", "3"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for command in ("restore:", "run -- true:", "status:", "--help:"):
        assert command in r.stdout, r.stdout[-2000:]
    restore = r.stdout.split("restore:", 1)[1].split("run -- true:", 1)[0]
    assert "azure.storage.blob" in restore and "azure.identity" not in restore, restore
