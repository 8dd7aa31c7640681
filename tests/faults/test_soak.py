"""Soak: a bounded, seeded random workload against a running sidecar, on both stores.

Writes, atomic replaces, in-place rewrites, deletes, renames of files and moves/removals of whole
context directories across nested ``user*/ctx*`` directories: a number of operations per store
(``SOAK_STEPS``, 3,000 in CI; the ``nightly`` run does 60,000), never a number of seconds, so the
verdict does not depend on the machine's speed. The sequence of operations depends only on
``SOAK_SEED`` (default 8); timing varies from run to run, which is the point.

Checked: the store ends byte-exact with the disk, nothing is left pending or failed, the sidecar
stops with exit 0, and a restore into an empty directory gives back the disk byte for byte.
"""

from __future__ import annotations

import json
import os
import random
import threading

import pytest

from support import disk_tree, run_cli, sidecar_env, store_tree, wait_for
from tests.faults.faultkit import Background, Workload, metrics, new_target, start_with_http, wait_converged_azure

pytestmark = pytest.mark.faults

SOAK_STEPS = int(os.environ.get("SOAK_STEPS", "3000"))
NIGHTLY_STEPS = 60_000
SOAK_SEED = int(os.environ.get("SOAK_SEED", "8"))


@pytest.mark.parametrize("steps", [SOAK_STEPS, pytest.param(NIGHTLY_STEPS, marks=pytest.mark.nightly)])
@pytest.mark.parametrize("kind", ["directory", pytest.param("azure", marks=pytest.mark.azure)])
def test_soak_random_workload_ends_byte_exact(kind, steps, tmp_path, request):
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    cps.mkdir(parents=True)
    target = None
    if kind == "directory":
        store_url, env = str(tmp_path / "store"), sidecar_env()
    else:
        target = new_target(request.getfixturevalue("azurite"), "soak")
        store_url, env = target.store_url, target.env()
    load = Workload(cps, SOAK_SEED)
    pace_rng = random.Random(SOAK_SEED + 1)
    pace = threading.Event()

    def step():
        if load.progress >= steps:
            return False
        load.step()
        if pace_rng.random() < 0.3:  # bursts and pauses
            pace.wait(pace_rng.uniform(0, 0.02))

    sc, base = start_with_http(work, "--store", store_url, "--reconcile-interval", "5", env=env)
    try:
        w = Background(step)
        w.start()
        max_pending = 0.0
        while w.is_alive():  # until the workload has done its steps
            max_pending = max(max_pending, metrics(base)["checkpoint_sidecar_pending_paths"])
            w.join(0.5)  # sampling pace
        w.stop()
        assert load.progress == steps
        if target is None:
            wait_for(lambda: store_tree(tmp_path / "store") == disk_tree(cps), 60, "the store to match the disk")
        else:
            wait_converged_azure(target, cps, 90)
        wait_for(lambda: metrics(base)["checkpoint_sidecar_pending_paths"] == 0, 30, "nothing pending")
        m = metrics(base)
        # the failures first (reconcile's findings are warnings too, and many)
        failures = "\n".join(json.dumps(e) for e in sorted(
            (e for e in sc.events() if e.get("level") in ("warning", "error")),
            key=lambda e: e.get("event") == "reconcile_found_changes")[:5])  # whole, not cut short
        assert m.get("checkpoint_sidecar_failures_total{kind=internal}", 0) == 0, failures
        assert m.get("checkpoint_sidecar_failures_total{kind=store}", 0) == 0, failures
        files = disk_tree(cps)
        print(f"\n{kind}: seed {SOAK_SEED}, {load.progress} operations {dict(sorted(load.counts.items()))}, "
              f"{len(files)} files at the end, max pending {max_pending:.0f}, "
              f"{m['checkpoint_sidecar_uploaded_files_total']:.0f} uploads, "
              f"{m['checkpoint_sidecar_deleted_files_total']:.0f} deletes, "
              f"{m.get('checkpoint_sidecar_reconcile_fixes_total', 0):.0f} reconcile fixes")
        assert sc.stop() == 0, sc.log()[-3000:]
    finally:
        sc.kill()
    try:
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        r = run_cli("restore", "--store", store_url, cwd=fresh, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert disk_tree(fresh / ".checkpoints") == disk_tree(cps)
    finally:
        if target is not None:
            target.drop()


def _contend(root, seed: int, steps: int) -> None:
    """One writer of four on the same few names, for ``steps`` operations: writes, atomic
    replaces, deletes, renames, and whole directories emptied and removed, so that paths are
    deleted and written again while their earlier operations are still queued or running."""
    rng = random.Random(seed)
    dirs = [root / f"u{i % 2}" / f"ctx{i}" for i in range(4)]
    for _ in range(steps):
        d = rng.choice(dirs)
        name = d / f"f{rng.randrange(20)}.json"
        op = rng.random()
        try:
            if op < 0.35:
                d.mkdir(parents=True, exist_ok=True)
                name.write_bytes(rng.randbytes(rng.randrange(1, 3000)))
            elif op < 0.55:
                d.mkdir(parents=True, exist_ok=True)
                tmp = name.with_name(f"{name.name}.{seed}.tmp")
                tmp.write_bytes(rng.randbytes(rng.randrange(1, 3000)))
                os.replace(tmp, name)
            elif op < 0.75:
                name.unlink()
            elif op < 0.9:
                os.rename(name, rng.choice(dirs) / f"f{rng.randrange(20)}.json")
            else:
                for f in d.iterdir():
                    f.unlink()
                d.rmdir()
        except OSError:
            pass  # another writer got there first


def test_contended_names_converge_with_nothing_left_pending(tmp_path):
    """Four writers on the same names in the same directories: the store must come to the disk,
    with nothing left pending (a queue that let an upload fall behind the delete barrier stalled
    here for good, and a reconcile leaves pending paths to their operations). Reconciles run
    every 2 s: a file deleted in a new directory before its watch exists gives no event, and
    only a rescan can see that (see sidecar.watcher)."""
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    cps.mkdir(parents=True)
    store = tmp_path / "store"
    sc, base = start_with_http(work, "--store", str(store), "--reconcile-interval", "2", env=sidecar_env())
    try:
        writers = [threading.Thread(target=_contend, args=(cps, SOAK_SEED + i, SOAK_STEPS // 2)) for i in range(4)]
        for t in writers:
            t.start()
        for t in writers:
            t.join()
        wait_for(lambda: store_tree(store) == disk_tree(cps), 60, "the store to match the disk")
        wait_for(lambda: metrics(base)["checkpoint_sidecar_pending_paths"] == 0, 30, "nothing pending")
        m = metrics(base)
        # the failures first (reconcile's findings are warnings too, and many)
        failures = "\n".join(json.dumps(e) for e in sorted(
            (e for e in sc.events() if e.get("level") in ("warning", "error")),
            key=lambda e: e.get("event") == "reconcile_found_changes")[:5])  # whole, not cut short
        assert m.get("checkpoint_sidecar_failures_total{kind=internal}", 0) == 0, failures
        assert m.get("checkpoint_sidecar_failures_total{kind=store}", 0) == 0, failures
        assert sc.stop() == 0, sc.log()[-3000:]
    finally:
        sc.kill()
