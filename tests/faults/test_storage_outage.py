"""Storage outage: Azurite stopped while the host keeps writing, for a number of writes
(``OUTAGE_WRITES``, 600) and at least until the sidecar has reported the outage and retried: the
outage is bounded by counts and events, never by seconds.

Checked: the backlog drains once the store is back and the store ends byte-exact with the disk;
memory stays bounded by the product's own accounting (pending work is coalesced per path:
``checkpoint_sidecar_pending_paths`` never exceeds the number of distinct paths written; RSS is
printed, not asserted: bench/ measures it); the degraded period shows in
``/metrics`` (``store_degraded`` 1, failures and retries counted) and in the ``/readyz`` body, while
``/readyz`` itself stays 200 (see docs/RELIABILITY.md for why).
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from support import disk_tree, wait_for, write_atomic
from tests.azurite import Azurite, AzuriteUnavailable, find_azurite_command
from tests.faults.faultkit import (
    Background,
    events,
    http_get,
    metrics,
    new_target,
    start_with_http,
    wait_converged_azure,
)

pytestmark = [pytest.mark.faults, pytest.mark.azure]

OUTAGE_WRITES = int(os.environ.get("OUTAGE_WRITES", "600"))
CONCURRENCY = 16  # the default --concurrency


def sample(base: str) -> dict:
    m = metrics(base)
    status, body = http_get(base, "/readyz")
    return {
        "pending": m.get("checkpoint_sidecar_pending_paths", 0),
        "degraded": m.get("checkpoint_sidecar_store_degraded", 0),
        "rss": m.get("checkpoint_sidecar_process_resident_memory_bytes", 0),
        "ready_status": status,
        "ready_body": body.strip(),
    }


def test_outage_backlog_drains_nothing_lost_memory_bounded(tmp_path):
    try:
        find_azurite_command()
    except AzuriteUnavailable as e:
        pytest.skip(str(e))
    server = Azurite(str(tmp_path / "azurite")).start()
    target = new_target(server.url, "outage")
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    cps.mkdir(parents=True)
    rng = random.Random(20261130)
    paths = [cps / f"user{u}" / f"ctx{c}" / f"{i:02}.json" for u in range(3) for c in range(4) for i in range(25)]
    written: set = set()
    sc = None
    try:
        sc, base = start_with_http(work, "--store", target.store_url, "--roots", str(cps), env=target.env())
        for p in paths[:100]:
            write_atomic(p, rng.randbytes(rng.randint(0, 4000)))
            written.add(p)
        wait_converged_azure(target, cps, 60, "the first 100 files mirrored")
        before = metrics(base)

        samples: list[dict] = []
        halt = threading.Event()

        def monitor() -> None:
            samples.append(sample(base))
            halt.wait(0.2)  # sampling pace, not a synchronisation

        mon = Background(monitor, halt)
        mon.start()
        lock = threading.Lock()
        done = [0]

        def writer() -> bool:  # writes through the outage: rewrites and deletes on 300 paths
            if done[0] >= OUTAGE_WRITES:
                return False
            done[0] += 1
            p = rng.choice(paths)
            with lock:
                if p.exists() and rng.random() < 0.15:
                    p.unlink()
                else:
                    write_atomic(p, rng.randbytes(rng.randint(0, 4000)))
                    written.add(p)
            halt.wait(0.003)
            return True

        server.stop()
        down_at = time.monotonic()
        w = Background(writer)
        w.start()
        # The outage lasts OUTAGE_WRITES writes, and at least until the sidecar has reported it
        # and retried.
        retried = lambda: metrics(base).get("checkpoint_sidecar_retries_total", 0) > before.get(  # noqa: E731
            "checkpoint_sidecar_retries_total", 0)
        wait_for(lambda: not w.is_alive() and any(s["degraded"] == 1 for s in samples) and retried(), 180,
                 "the outage's writes, and checkpoint_sidecar_store_degraded=1", interval=0.1)
        during = metrics(base)
        server.start()
        up_at = time.monotonic()
        w.stop()  # writes stop shortly after the store is back; the backlog must drain
        writes_done_at = time.monotonic()
        wait_converged_azure(target, cps, 120, "the backlog to drain after the outage")
        drained_at = time.monotonic()
        wait_for(lambda: sample(base)["degraded"] == 0, 30, "store_degraded back to 0")
        mon.stop()
        after = metrics(base)
        final = sample(base)

        # nothing lost, nothing stale: byte-exact (wait_converged_azure compared every blob)
        assert target.tree(".checkpoints") == disk_tree(cps)
        # memory bounded: pending coalesced per path, RSS modest. The gauge counts queue entries: a
        # path being uploaded that changed again counts twice (running + waiting), so it can pass
        # the distinct paths by up to --concurrency; see test_pending_gauge_counts_distinct_paths.
        max_pending = max(s["pending"] for s in samples)
        assert max_pending <= len(written), (max_pending, len(written))
        assert max_pending > 0
        max_rss = max(s["rss"] for s in samples)
        # the degraded period is visible: metrics, log, and the /readyz body (still 200)
        degraded = [s for s in samples if s["degraded"] == 1]
        assert degraded and all(s["ready_status"] == 200 for s in samples)
        assert any("store degraded for" in s["ready_body"] for s in degraded), degraded[-1]
        assert final["ready_status"] == 200 and "degraded" not in final["ready_body"]
        fails = lambda m: sum(v for k, v in m.items() if k.startswith("checkpoint_sidecar_failures_total"))  # noqa: E731
        assert fails(during) > fails(before) and fails(after) >= fails(during)
        assert during["checkpoint_sidecar_retries_total"] > before.get("checkpoint_sidecar_retries_total", 0)
        assert during.get("checkpoint_sidecar_failures_total{kind=transient}", 0) > 0
        assert after["checkpoint_sidecar_pending_paths"] == 0
        assert events(sc, "store_retry") and events(sc, "store_recovered")
        print(f"\noutage {up_at - down_at:.1f}s, {len(written)} distinct paths, max pending {max_pending:.0f}, "
              f"RSS {before['checkpoint_sidecar_process_resident_memory_bytes'] / 2**20:.0f} -> "
              f"max {max_rss / 2**20:.0f} MiB, backlog drained {drained_at - writes_done_at:.1f}s after the "
              f"last write ({drained_at - up_at:.1f}s after the store came back)")
        assert sc.stop() == 0, sc.log()[-3000:]
        sc = None
    finally:
        if sc is not None:
            sc.kill()
        server.stop()


@pytest.mark.azure
def test_a_store_that_never_answers_is_never_a_silent_wait(tmp_path):
    """An endpoint that accepts connections and never answers (a blackholed route, a stuck
    proxy): the sidecar says at once that it waits and for what, and then again periodically."""
    import socket

    from support import Sidecar, sidecar_env
    from tests.azurite import connection_string

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/devstoreaccount1"
    env = {k: v for k, v in sidecar_env().items() if not k.startswith("AZURE_")}
    env.update(SIDECAR_STORE=f"{url}/silent", AZURE_STORAGE_CONNECTION_STRING=connection_string(url))
    work = tmp_path / "w"
    work.mkdir()
    sc = Sidecar(work, "restore", env=env)
    try:
        first = sc.wait_event("still_waiting", 20)
        assert "the store to answer" in first["what"] and "127.0.0.1" in first["store"]
        wait_for(lambda: sum(e.get("event") == "still_waiting" for e in sc.events()) >= 2, 20, "a second report")
    finally:
        sc.kill()
        silent.close()
