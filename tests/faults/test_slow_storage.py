"""Slow storage and throttling: a proxy (tests/proxy.py) in front of Azurite delays every request,
then answers 503 and 429 for a while instead of forwarding.

Checked: operations are retried (the SDK retries 503 with its jittered exponential backoff; 429 and
an exhausted SDK budget reach the sidecar, which retries with its own backoff and jitter), and
nothing is written twice or out of order: per blob, the version stamps of the writes the store
accepted strictly increase, the path rewritten many times ends with its newest version, and the
whole store ends byte-exact with the disk.
"""

from __future__ import annotations

import random
import threading
from collections import defaultdict

import pytest

from sidecar.retry import BACKOFF_MAX, backoff
from support import disk_tree, wait_for, write_atomic
from tests.faults.faultkit import Background, events, metrics, new_target, start_with_http, wait_converged_azure
from tests.proxy import Proxy

pytestmark = [pytest.mark.faults, pytest.mark.azure]


def test_backoff_is_exponential_with_full_jitter():
    for attempt in (1, 2, 5, 12):
        d = min(BACKOFF_MAX, 0.1 * 2 ** (attempt - 1))
        values = [backoff(attempt) for _ in range(200)]
        assert all(d / 2 <= v <= d for v in values)
        assert len(set(values)) > 150  # jittered: retries of many paths do not move in lockstep


def test_latency_and_throttling_retried_without_duplicates_or_reordering(azurite, tmp_path):
    target = new_target(azurite, "slow")
    proxy = Proxy.before(azurite.url)
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    cps.mkdir(parents=True)
    rng = random.Random(424242)
    hot = cps / "user0" / "ctx0" / "hot.json"
    others = [cps / f"user{i % 3}" / f"ctx{i % 5}" / f"{i:03}.json" for i in range(150)]
    version = 0

    def rewrite_hot() -> None:
        nonlocal version
        version += 1
        write_atomic(hot, f'{{"version": {version}}}'.encode() + rng.randbytes(rng.randint(0, 3000)))

    sc = None
    try:
        proxy.set(latency=0.05)
        sc, base = start_with_http(work, "--store", proxy.via(target.store_url), "--roots", str(cps),
                                   env=target.env(proxy.via(azurite.url)))
        # phase 1: every request takes 50 ms
        for i, p in enumerate(others[:100]):
            write_atomic(p, rng.randbytes(rng.randint(0, 3000)))
            if i % 2 == 0:
                rewrite_hot()
        hot_blob = ".checkpoints/user0/ctx0/hot.json"
        wait_for(lambda: proxy.count("forwarded", 201) >= 50 and any(
            r.blob == hot_blob and r.status == 201 for r in list(proxy.records)), 60, "writes through the slow proxy")
        # phase 2: throttled: 503 and 429 in turn, nothing reaches the store
        proxy.set(fail_with=[503, 429])
        for i, p in enumerate(others[100:]):
            write_atomic(p, rng.randbytes(rng.randint(0, 3000)))
            rewrite_hot()
            if i % 3 == 0:
                others[i].unlink()  # deletes too: barriers behind the uploads
        pace = threading.Event()

        def keep_writing() -> None:  # the host goes on checkpointing while throttled
            rewrite_hot()
            pace.wait(0.02)

        writer = Background(keep_writing)
        writer.start()
        try:
            wait_for(lambda: proxy.count("failed", 503) >= 30 and proxy.count("failed", 429) >= 30
                     and any("throttled" in e.get("error", "") and e.get("attempt", 0) >= 2
                             for e in events(sc, "store_retry")),
                     90, "throttled requests retried by the SDK and, with backoff, by the sidecar")
        finally:
            writer.stop()
        throttled = metrics(base)
        # phase 3: throttling lifted, still slow-ish; one last version of the hot path
        proxy.set(fail_with=[], latency=0.01)
        rewrite_hot()
        wait_converged_azure(target, cps, 90)

        blobs = target.all_blobs()
        md, data = blobs[hot_blob]
        assert data == hot.read_bytes() and data.startswith(f'{{"version": {version}}}'.encode())
        assert int({k.lower(): v for k, v in md.items()}["sidecar_mtime_ns"]) == hot.stat().st_mtime_ns
        assert target.tree(".checkpoints") == disk_tree(cps)

        accepted = defaultdict(list)
        for r in proxy.records:
            if r.method == "PUT" and r.status == 201 and r.stamp is not None and r.blob.startswith(".checkpoints/"):
                accepted[r.blob].append(r.stamp)
        for blob, stamps in accepted.items():
            in_order = all(a < b for a, b in zip(stamps, stamps[1:], strict=False))
            assert in_order, f"{blob}: writes accepted out of order or twice: {stamps}"
        hot_writes = accepted[hot_blob]
        assert 2 <= len(hot_writes) <= version  # one while slow, the newest after the throttling
        assert throttled["checkpoint_sidecar_retries_total"] > 0
        assert throttled.get("checkpoint_sidecar_failures_total{kind=transient}", 0) > 0
        assert throttled["checkpoint_sidecar_store_degraded"] == 1
        after = metrics(base)
        assert after["checkpoint_sidecar_store_degraded"] == 0 and after["checkpoint_sidecar_pending_paths"] == 0
        print(f"\nproxy: {proxy.count('forwarded')} forwarded, {proxy.count('failed', 503)} x 503, "
              f"{proxy.count('failed', 429)} x 429; hot path: {version} versions written, "
              f"{len(hot_writes)} stored (coalesced)")
        assert sc.stop() == 0, sc.log()[-3000:]
        sc = None
    finally:
        if sc is not None:
            sc.kill()
        proxy.stop()
        target.drop()
