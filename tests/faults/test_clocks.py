"""No decision compares clocks: versions come from the sidecar, fencing waits on its own clock.

* a file written with a future mtime (a clock stepped back, an extracted archive) does not freeze
  its key: later writes are stored, whatever their mtimes;
* a predecessor's marker written by a clock an hour ahead delays our first upload by one write
  window and the margin, not an hour, and the wait shows in ``/readyz`` and the metrics;
* a store copied without mtimes (``cp -r``) is used as it was, nobody fenced.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import anyio
import pytest

from support import Sidecar, disk_tree, run_cli, sidecar_env, store_tree, wait_for, write_atomic
from tests.faults.faultkit import http_get, metrics

pytestmark = pytest.mark.faults

YEAR_NS = 365 * 24 * 3600 * 10**9


def target(kind, tmp_path, request):
    if kind == "azure":
        from tests.faults.faultkit import new_target

        t = new_target(request.getfixturevalue("azurite"), "clock")
        return t.env(SIDECAR_STORE=t.store_url), lambda: t.tree(".checkpoints"), t
    return sidecar_env(SIDECAR_STORE=str(tmp_path / "store")), lambda: store_tree(tmp_path / "store"), None


@pytest.mark.parametrize("kind", ["directory", pytest.param("azure", marks=pytest.mark.azure)])
def test_a_future_mtime_never_freezes_a_key(kind, tmp_path, request):
    env, stored, t = target(kind, tmp_path, request)
    try:
        work = tmp_path / "w"
        work.mkdir()
        f = work / ".checkpoints" / "c" / "state.json"
        write_atomic(f, b"from a clock a year ahead")
        os.utime(f, ns=(time.time_ns() + YEAR_NS,) * 2)
        sc = Sidecar(work, "sync", env=env)
        sc.wait_event("ready")
        wait_for(lambda: stored() == {"c/state.json": b"from a clock a year ahead"}, 20, "the first version")
        write_atomic(f, b"written now, an older mtime")  # the clock is back
        wait_for(lambda: stored() == {"c/state.json": b"written now, an older mtime"}, 20, "the later write stored")
        assert not sc.has_event("file_older_than_stored")
        assert sc.stop() == 0
    finally:
        if t is not None:
            t.drop()


@pytest.mark.parametrize("kind", ["directory", pytest.param("azure", marks=pytest.mark.azure)])
def test_a_predecessor_clock_an_hour_ahead_delays_uploads_by_one_window(kind, tmp_path, request):
    from sidecar.marker import OWNER_KEY
    from sidecar.store import make_store
    from sidecar.store.base import ObjectMeta

    env, stored, t = target(kind, tmp_path, request)
    env.update(SIDECAR_FENCE_WINDOW="1", SIDECAR_FENCE_MARGIN="2")
    stamp = 3 << 32
    marker = json.dumps({"generation": stamp, "owner": "ahead", "heartbeat": time.time() + 3600}).encode()

    async def plant() -> None:
        store = make_store(env["SIDECAR_STORE"], env={"AZURE_STORAGE_CONNECTION_STRING": t.conn} if kind == "azure" else {})
        await store.open()
        try:
            await store.put(OWNER_KEY, marker, ObjectMeta.of(marker, stamp, 0o600, version=stamp))
        finally:
            await store.aclose()

    try:
        anyio.run(plant)
        work = tmp_path / "w"
        work.mkdir()
        sc = Sidecar(work, "sync", "--http-addr", "127.0.0.1:0", env=env)
        base = f"http://{sc.wait_event('http_listening')['addr']}"
        sc.wait_event("fence_claimed")
        write_atomic(work / ".checkpoints" / "a.json", b"waits a window, not an hour")
        waited = sc.wait_event("fence_wait")
        assert waited["seconds"] == 3.0
        status, body = http_get(base, "/readyz")
        assert status == 200 and ("uploads wait" in body or stored()), body
        assert metrics(base)["checkpoint_sidecar_fence_wait_seconds"] > 0
        wait_for(lambda: stored() == {"a.json": b"waits a window, not an hour"}, 20, "the upload after the window")
        assert sc.stop() == 0
    finally:
        if t is not None:
            t.drop()


def test_a_store_copied_without_mtimes_is_used_as_it_was(tmp_path):
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"))
    old = tmp_path / "old"
    write_atomic(old / ".checkpoints" / "c" / "a.json", b"before the copy")
    assert run_cli("run", "--", "true", cwd=old, env=env).returncode == 0
    shutil.copytree(tmp_path / "store", tmp_path / "copy", copy_function=shutil.copyfile)  # cp -r: no mtimes

    copied = sidecar_env(SIDECAR_STORE=str(tmp_path / "copy"))
    new = tmp_path / "new"
    new.mkdir()
    sc = Sidecar(new, "sync", env=copied)
    sc.wait_event("ready")
    assert disk_tree(new / ".checkpoints") == {"c/a.json": b"before the copy"}
    write_atomic(new / ".checkpoints" / "c" / "b.json", b"after the copy")
    wait_for(lambda: store_tree(tmp_path / "copy") == disk_tree(new / ".checkpoints"), 20, "mirrored into the copy")
    assert sc.stop() == 0
    assert not sc.has_event("fenced")
