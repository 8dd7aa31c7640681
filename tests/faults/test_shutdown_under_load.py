"""Shutdown under load: SIGTERM while a slow store (tests/proxy.py in front of Azurite) has a large
backlog. Either the backlog drains within ``--drain-timeout`` (exit 0, ``shutdown_flushed``, store
byte-exact with the disk), or the sidecar says exactly what it left (exit 75, ``shutdown_pending``
with the count and the first 20 paths, which are exactly the differences between disk and store).
"""

from __future__ import annotations

import random
import signal

import pytest

from support import disk_tree, run_cli, wait_for, write_atomic
from tests.faults.faultkit import events, metrics, new_target, start_with_http, wait_converged_azure
from tests.proxy import Proxy

pytestmark = [pytest.mark.faults, pytest.mark.azure]


def differences(disk: dict[str, bytes], store: dict[str, bytes], root: str = ".checkpoints") -> list[str]:
    keys = set(disk) | set(store)
    return sorted(f"{root}/{k}" for k in keys if disk.get(k) != store.get(k))


@pytest.fixture
def slow(azurite, tmp_path):
    target = new_target(azurite, "drain")
    proxy = Proxy.before(azurite.url)
    work = tmp_path / "work"
    (work / ".checkpoints").mkdir(parents=True)
    yield target, proxy, work
    proxy.stop()
    target.drop()


def start(slow, *extra: str):
    target, proxy, work = slow
    return start_with_http(work, "--store", proxy.via(target.store_url), "--roots", str(work / ".checkpoints"),
                           *extra, env=target.env(proxy.via(target.endpoint_url)))


def test_sigterm_with_a_backlog_drains_within_the_timeout(slow):
    target, proxy, work = slow
    cps = work / ".checkpoints"
    rng = random.Random(5)
    proxy.set(latency=0.03)
    sc, base = start(slow, "--concurrency", "4", "--drain-timeout", "120")
    try:
        for i in range(300):
            write_atomic(cps / f"user{i % 3}" / f"ctx{i % 7}" / f"{i:03}.json", rng.randbytes(rng.randint(0, 3000)))
        wait_for(lambda: metrics(base)["checkpoint_sidecar_pending_paths"] >= 100, 30, "a backlog")
        backlog = metrics(base)["checkpoint_sidecar_pending_paths"]
        code = sc.stop(signal.SIGTERM, timeout=150)
    except BaseException:
        sc.kill()
        raise
    assert code == 0, sc.log()[-3000:]
    assert events(sc, "shutdown_flushed") and not events(sc, "shutdown_pending")
    assert target.tree(".checkpoints") == disk_tree(cps)
    print(f"\nSIGTERM with {backlog:.0f} paths pending behind a 30 ms store: drained, exit 0")


def test_sigterm_that_cannot_drain_reports_exactly_what_is_left(slow):
    target, proxy, work = slow
    cps = work / ".checkpoints"
    rng = random.Random(6)
    sc, base = start(slow, "--drain-timeout", "2")
    try:
        old = [cps / "user0" / "ctx0" / f"old{i}.json" for i in range(10)]
        for p in old:
            write_atomic(p, rng.randbytes(500))
        wait_converged_azure(target, cps, 30)
        proxy.set(hold=True)  # from now on nothing reaches the store
        for i in range(60):
            write_atomic(cps / f"user{i % 3}" / f"ctx{i % 4}" / f"new{i:02}.json", rng.randbytes(rng.randint(0, 3000)))
        for p in old[:5]:
            write_atomic(p, b"changed while the store hangs")
        for p in old[5:8]:
            p.unlink()
        wait_for(lambda: metrics(base)["checkpoint_sidecar_pending_paths"] >= 68, 30, "68 changes pending")
        code = sc.stop(signal.SIGTERM, timeout=60)
    except BaseException:
        sc.kill()
        raise
    assert code == 75, sc.log()[-3000:]
    left = events(sc, "shutdown_pending")
    assert len(left) == 1 and not events(sc, "shutdown_flushed")
    diff = differences(disk_tree(cps), target.tree(".checkpoints"))
    assert len(diff) == 68
    assert left[0]["pending"] == len(diff)
    assert left[0]["paths"] == ",".join(diff[:20])
    # a later `status` (straight to Azurite) agrees
    r = run_cli("status", "--json", "--store", target.store_url, "--roots", str(cps), cwd=work,
                env=target.env())
    assert r.returncode == 1, r.stdout + r.stderr
    import json

    report = json.loads(r.stdout)["roots"][".checkpoints"]
    assert sorted(report["pending_upload"] + report["missing_locally"]) == diff


def test_pending_gauge_counts_distinct_paths(slow):
    target, proxy, work = slow
    cps = work / ".checkpoints"
    sc, base = start(slow)
    try:
        proxy.set(hold=True)  # every upload taken by a worker stays in flight
        files = [cps / "ctx" / f"{i:02}.json" for i in range(20)]
        for p in files:
            write_atomic(p, b"v1")
        wait_for(lambda: metrics(base)["checkpoint_sidecar_pending_paths"] >= 20, 30, "20 paths pending")
        seen = metrics(base)["checkpoint_sidecar_watch_events_total"]
        for p in files:
            write_atomic(p, b"v2")  # each path again, while its first upload is still running
        wait_for(lambda: metrics(base)["checkpoint_sidecar_watch_events_total"] >= seen + 20, 30, "the rewrites seen")
        gauge = metrics(base)["checkpoint_sidecar_pending_paths"]
        assert gauge <= len(files), f"{gauge} pending 'paths' for {len(files)} distinct paths"
    finally:
        sc.kill()
