"""An idle live sidecar rewrites its owner marker at SIDECAR_HEARTBEAT_INTERVAL (recorded in the
marker), so ``sessions`` keeps it ``live`` by the store's clock however long its workflow waits;
its clean exit releases it."""

from __future__ import annotations

import json

import anyio

from sidecar.marker import OWNER_KEY
from sidecar.store.base import NotFound
from sidecar.store.directory import DirectoryStore
from support import Sidecar, run_cli, sidecar_env, wait_for


def marker_times(store_dir, namespace: str) -> tuple[dict, float]:
    async def read() -> tuple[dict, float]:
        store = DirectoryStore(str(store_dir), namespace)
        data, info = await store.get(OWNER_KEY)
        return json.loads(data), info.modified or 0.0

    return anyio.run(read)


def test_an_idle_sidecar_keeps_its_marker_fresh_and_live(tmp_path):
    work, store = tmp_path / "work", tmp_path / "store"
    (work / ".checkpoints").mkdir(parents=True)
    store.mkdir()
    (work / ".checkpoints" / "a.json").write_text("{}")
    env = sidecar_env(SIDECAR_STORE=str(store), SIDECAR_HEARTBEAT_INTERVAL="0.3", FOUNDRY_AGENT_SESSION_ID="s1")
    sc = Sidecar(work, "sync", env=env)
    try:
        sc.wait_event("ready")
        def recorded():
            try:
                marker, when = marker_times(store, "_/s1")
            except NotFound:  # "ready" comes before the claim writes the marker
                return None
            return when if marker.get("interval") == 0.3 else None

        t0 = wait_for(recorded, 10, "the marker recording its interval")
        # idle (nothing written): the marker is rewritten again and again
        seen = {t0}
        wait_for(lambda: seen.add(marker_times(store, "_/s1")[1]) or len(seen) >= 3, 10, "two more heartbeats")
        listed = run_cli("sessions", "--json", "--live-within", "1h", cwd=tmp_path,
                         env=sidecar_env(SIDECAR_STORE=str(store)))
        assert [json.loads(x)["owner"] for x in listed.stdout.splitlines()] == ["live"], listed
    finally:
        assert sc.stop() == 0, sc.log()
    marker, _ = marker_times(store, "_/s1")
    assert marker["heartbeat"] == 0 and marker["identity"] == {"FOUNDRY_AGENT_SESSION_ID": "s1"}
