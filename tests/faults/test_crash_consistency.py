"""Snapshot commits: killed at any point, the store only ever holds a state the disk passed through.

A writer mimics the AgentServer host at every superstep: it rewrites the checkpoints store (which
keeps every checkpoint) and then the bindings store, which points at the newest checkpoint. The
disk therefore only ever holds ``bindings == n`` with ``checkpoints == 0..n`` or ``0..n+1``. The
sidecar process is SIGKILLed while the writer runs, each time right after a commit of that round
landed (an event, never a timer), and after each kill the store is restored into an empty directory
and checked against that rule. Every crash point of a run is enumerated in process by
tests/integration/test_crash_enumeration.py; this test keeps the real SIGKILL.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from support import Sidecar, run_cli, wait_for
from tests.integration.test_crash_enumeration import consistent

pytestmark = pytest.mark.faults

WRITER = r"""
import json, os, random, sys, time
random.seed(int(sys.argv[2]))
root = sys.argv[1]
d = os.path.join(root, "state_stores")
os.makedirs(d, exist_ok=True)
def put(name, obj):
    tmp = os.path.join(d, f".{name}.{random.getrandbits(32):x}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, os.path.join(d, name))
items = []
n = 0
while True:
    items.append({"id": n, "value": "x" * random.randint(10, 4000)})
    put("checkpoints.json", {"items": items})
    if random.random() < 0.5:
        time.sleep(random.uniform(0, 0.003))
    put("bindings.json", {"checkpoint": n})
    n += 1
    time.sleep(random.uniform(0, 0.004))
"""


ROUNDS = 3


def _stored_binding(store) -> bytes | None:
    path = store / "state" / "state_stores" / "bindings.json"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def test_every_restorable_state_is_one_the_disk_had(tmp_path):
    work, store = tmp_path / "work", tmp_path / "store"
    state = work / "state"
    state.mkdir(parents=True)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(state), "20261130"])
    seen_bundles = 0
    try:
        wait_for(lambda: (state / "state_stores" / "bindings.json").exists(), 10, "writer started")
        for round_ in range(ROUNDS):
            before = _stored_binding(store)
            sc = Sidecar(work, "sync", "--store", str(store), "--roots", str(state), "--commit", "snapshot",
                         "--log-level", "debug")
            sc.wait_event("ready")
            # killed right after a commit of this round landed, while the next ones are under way
            wait_for(lambda: _stored_binding(store) != before, 30, "a commit of this round")  # noqa: B023
            sc.kill()
            seen_bundles += (store / ".sidecar" / "bundles" / "state").exists()
            fresh = tmp_path / f"restored-{round_}" / "state"
            r = run_cli("restore", "--store", str(store), "--roots", str(fresh), cwd=tmp_path)
            assert r.returncode == 0, r.stderr
            ok, why = consistent(fresh)
            if not ok:
                per_file = consistent(store / "state")
                bundle = store / ".sidecar" / "bundles" / "state"
                head = bundle.read_bytes().split(b"\n")[0][:300] if bundle.exists() else None
                print("PER-FILE", per_file, "BUNDLE", head)
            assert ok, f"round {round_}: restored a state the disk never had: {why}\n{sc.log()[-3000:]}"
            shutil.rmtree(fresh.parent)
    finally:
        writer.kill()
        writer.wait()
    print(f"bundles left behind by kills: {seen_bundles}/{ROUNDS}")
