"""Crash mid-burst: the sidecar is SIGKILLed at seeded random points while 1,000 files are written,
replaced and deleted (Azure store on Azurite), and restarted each time while the writes go on.

Checked: after the last restart the store converges to the disk byte for byte, and nothing stale
survives: the container holds exactly the files on disk (plus the sidecar's own ``.sidecar/`` owner
marker), no object of a deleted file, no older version of a replaced one.
"""

from __future__ import annotations

import os
import random
import threading

import pytest

from support import Sidecar, disk_tree, write_atomic
from tests.faults.faultkit import Background, new_target, wait_converged_azure

pytestmark = [pytest.mark.faults, pytest.mark.azure]

SEED = int(os.environ.get("CRASH_SEED", "20261130"))
FILES = 1000
KILLS = 5


def plan(rng: random.Random, cps) -> list[tuple[str, object]]:
    """1,000 creates with replaces and deletes of existing files mixed in."""
    names = [cps / f"user{i % 5}" / f"ctx{i % 20}" / f"{i:04}.json" for i in range(FILES)]
    ops: list[tuple[str, object]] = []
    alive: list = []
    created = 0
    while created < FILES:
        r = rng.random()
        if r < 0.55 or not alive:
            ops.append(("write", names[created]))
            alive.append(names[created])
            created += 1
        elif r < 0.85:
            ops.append(("replace", rng.choice(alive)))
        else:
            ops.append(("delete", alive.pop(rng.randrange(len(alive)))))
    return ops


def test_sigkill_mid_burst_converges_and_leaves_nothing_stale(azurite, tmp_path):
    rng = random.Random(SEED)
    target = new_target(azurite, "crash")
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    cps.mkdir(parents=True)
    ops = plan(rng, cps)
    kill_points = sorted(rng.sample(range(50, len(ops) - 50), KILLS))
    data_rng = random.Random(SEED + 1)
    pace = threading.Event()
    it = iter(ops)
    done = [0]

    def writer():
        op = next(it, None)
        if op is None:
            return False
        kind, path = op
        if kind == "delete":
            path.unlink()
        else:
            write_atomic(path, data_rng.randbytes(data_rng.randint(0, 2000)))
        done[0] += 1
        pace.wait(0.002)  # pacing, so the kills land while the burst is going on

    def start() -> Sidecar:
        return Sidecar(work, "sync", "--store", target.store_url, "--roots", str(cps), env=target.env())

    sc = start()
    killed_at = []
    try:
        sc.wait_event("ready", 30)
        w = Background(writer)
        w.start()
        for point in kill_points:
            while done[0] < point and w.is_alive():
                pace.wait(0.001)
            sc.kill()  # SIGKILL, whatever it was doing
            killed_at.append(done[0])
            sc = start()  # restarted at once, while the writes go on
            sc.wait_event("ready", 30)
        w.join(120)
        assert not w.is_alive()
        w.stop()
        wait_converged_azure(target, cps, 120, "the store to converge after the last restart")
        everything = {name: data for name, (_md, data) in target.all_blobs().items() if not name.startswith(".sidecar/")}
        assert everything == {f".checkpoints/{k}": v for k, v in disk_tree(cps).items()}
        deleted = sum(1 for kind, _ in ops if kind == "delete")
        print(f"\n{len(ops)} operations ({FILES} files, {deleted} deleted), SIGKILL after ops {killed_at}; "
              f"{len(everything)} objects, all byte-exact, none stale")
        assert sc.stop() == 0, sc.log()[-3000:]
    finally:
        sc.kill()
        target.drop()
