"""A store written by the release before versions (no ``version`` in records, no
``sidecar_version`` metadata, the owner marker ordered by its mtime stamp) keeps working: it is
restored, the new sidecar claims it and mirrors into it, and its later writes are not refused."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import anyio
import pytest

from support import disk_tree, json_lines, run_cli, sidecar_env, store_tree

pytestmark = pytest.mark.faults

OLD_STAMP = (4 << 32) | 12345  # the previous owner's generation 4
FILES = {".checkpoints/ctx/a.json": b'{"old": "format"}', ".checkpoints/b.json": b"kept as it was"}
MTIME = 1_700_000_000_123_456_789


def old_record(data: bytes, mtime_ns: int, data_mtime_ns: int) -> bytes:
    return json.dumps({"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "mtime_ns": mtime_ns,
                       "mode": 0o600, "data_mtime_ns": data_mtime_ns}).encode()


def write_old_directory_store(top: Path) -> None:
    marker = json.dumps({"generation": OLD_STAMP, "owner": "old", "heartbeat": 0}).encode()
    for key, data, mtime in [*((k, v, MTIME) for k, v in FILES.items()), (".sidecar/owner", marker, OLD_STAMP)]:
        path = top / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, ns=(mtime, mtime))
        head, _, name = key.rpartition("/")
        record = top / ".sidecar-meta" / head / f"{name}.json"
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_bytes(old_record(data, mtime, path.stat().st_mtime_ns))


async def write_old_azure_store(conn: str, container: str) -> None:
    from azure.storage.blob.aio import BlobServiceClient

    marker = json.dumps({"generation": OLD_STAMP, "owner": "old", "heartbeat": 0}).encode()
    async with BlobServiceClient.from_connection_string(conn) as svc:
        c = svc.get_container_client(container)
        await c.create_container()
        for key, data, mtime in [*((k, v, MTIME) for k, v in FILES.items()), (".sidecar/owner", marker, OLD_STAMP)]:
            await c.upload_blob(key, data, metadata={"sidecar_sha256": hashlib.sha256(data).hexdigest(),
                                                     "sidecar_mtime_ns": str(mtime), "sidecar_mode": "600"})


@pytest.mark.parametrize("kind", ["directory", pytest.param("azure", marks=pytest.mark.azure)])
def test_a_store_of_the_previous_format_is_restored_claimed_and_written(kind, tmp_path, request):
    target = None
    if kind == "azure":
        from tests.faults.faultkit import new_target

        target = new_target(request.getfixturevalue("azurite"), "oldfmt")
        anyio.run(write_old_azure_store, target.conn, target.container)
        env = target.env(SIDECAR_STORE=target.store_url)
        stored = lambda: target.tree(".checkpoints")  # noqa: E731
    else:
        write_old_directory_store(tmp_path / "store")
        env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"))
        stored = lambda: store_tree(tmp_path / "store")  # noqa: E731
    try:
        work = tmp_path / "w"
        work.mkdir()
        # restored, then a rewrite of an old object (its mtime older than the stored one's) and a new file
        script = ("import os; p='.checkpoints/ctx/a.json'; assert open(p).read() == '{\"old\": \"format\"}'; "
                  "open(p + '.tmp', 'w').write('rewritten'); os.replace(p + '.tmp', p); os.utime(p, ns=(1, 1)); "
                  "open('.checkpoints/c.json', 'w').write('new')")
        r = run_cli("run", "--", "python3", "-c", script, cwd=work, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        events = json_lines(r.stderr)
        claimed = [e for e in events if e.get("event") == "fence_claimed"]
        assert claimed and claimed[0]["generation"] == 5, r.stderr[-2000:]  # above the old owner's 4
        assert not any(e.get("event") in ("fenced", "file_older_than_stored") for e in events)
        want = {"ctx/a.json": b"rewritten", "b.json": b"kept as it was", "c.json": b"new"}
        assert stored() == want
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        assert run_cli("restore", cwd=fresh, env=env).returncode == 0
        assert disk_tree(fresh / ".checkpoints") == want
    finally:
        if target is not None:
            target.drop()
