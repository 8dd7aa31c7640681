"""Crash consistency by enumeration: a crash right after any one store mutation leaves a store whose
restore is a state the disk had.

The sidecar runs in this process (snapshot commits) on a store that records every mutation that
lands, while a writer mimics the AgentServer host at every superstep: it rewrites the checkpoints
file (which keeps every checkpoint), then the bindings file, which names the newest checkpoint.
The disk therefore only ever holds ``bindings == n`` with ``checkpoints == 0..n`` or
``0..n+1``. Then, for every k of the N mutations, the store as a crash after the k-th left it is
rebuilt by replaying the first k, restored into an empty directory, and checked against that rule.
A failure names its k and the mutations up to it. (tests/faults/test_crash_consistency.py keeps
one real SIGKILL of a sidecar process.)
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio

from sidecar import lifecycle
from support import store_tree, write_atomic
from tests.inprocess import InProcess, RecordingStore, replay, run_sync, settings_for

STEPS = 40


def consistent(state_dir: Path) -> tuple[bool, str]:
    """Whether ``state_dir`` holds a state the writer's disk passed through, and what it holds."""
    cp_path = state_dir / "state_stores" / "checkpoints.json"
    b_path = state_dir / "state_stores" / "bindings.json"
    if not cp_path.exists():
        return not b_path.exists(), "bindings without checkpoints"
    ids = [i["id"] for i in json.loads(cp_path.read_text())["items"]]
    if ids != list(range(len(ids))):
        return False, f"torn checkpoints: {ids[:5]}..."
    if not b_path.exists():
        return len(ids) == 1, f"{len(ids)} checkpoints, no bindings"
    b = json.loads(b_path.read_text())["checkpoint"]
    return b in (len(ids) - 1, len(ids) - 2), f"bindings -> {b} with checkpoints 0..{len(ids) - 1}"


def test_a_crash_after_any_mutation_restores_a_state_the_disk_had(tmp_path):
    # snapshot commits: per-file uploads promise each file whole, not two files from one moment
    commit = "snapshot"
    work = tmp_path / "work"
    state = work / "state"
    state.mkdir(parents=True)
    store = RecordingStore(str(tmp_path / "store"))
    settings, roots = settings_for(work, str(tmp_path / "store"), roots=[str(state)], commit=commit)
    stores = state / "state_stores"

    async def host(life: InProcess) -> None:
        items: list[dict] = []
        for n in range(STEPS):
            items.append({"id": n, "value": "x" * (10 + 97 * n % 4000)})
            write_atomic(stores / "checkpoints.json", json.dumps({"items": items}).encode())
            write_atomic(stores / "bindings.json", json.dumps({"checkpoint": n}).encode())
            if n % 2 == 1:  # now and then, let the mirror catch up with a burst (a count, not a time)
                landed = len(store.log)
                with anyio.fail_after(30):
                    while len(store.log) == landed:
                        await anyio.sleep(0.002)
        with anyio.fail_after(60):  # the end: everything mirrored
            while not (life.daemon.uploader.pending.idle()
                       and store_tree(tmp_path / "store", "state").get("state_stores/bindings.json")
                       == (stores / "bindings.json").read_bytes()):
                await anyio.sleep(0.005)

    code = anyio.run(run_sync, InProcess(settings, roots, store), host)
    assert code == 0
    log = list(store.log)
    assert any(m.key.endswith("bindings.json") for m in log), [str(m) for m in log]

    async def restored_after(k: int) -> Path:
        at = tmp_path / f"crash-{k}"
        await replay(log[:k], str(at / "store"))
        fresh = at / "fresh" / "state"
        s, r = settings_for(at, str(at / "store"), roots=[str(fresh)], commit=commit)
        assert await lifecycle.restore(s, r) == 0
        return fresh

    for k in range(len(log) + 1):
        fresh = anyio.run(restored_after, k)
        ok, why = consistent(fresh)
        assert ok, (f"a crash after mutation {k} of {len(log)} restores a state the disk never had: {why}\n"
                    + "\n".join(f"{i + 1}. {m}" for i, m in enumerate(log[:k])))
    print(f"\n{commit}: {len(log)} mutations, every crash point restores a state the disk had")

