"""``status`` only reads: pointed at a store that does not exist yet, it reports and creates nothing."""

from __future__ import annotations

import anyio
import pytest
from azure.storage.blob.aio import BlobServiceClient
from support import run_cli, sidecar_env

from tests.faults.faultkit import new_target


def test_status_on_a_missing_directory_store_creates_nothing(tmp_path):
    work, store = tmp_path / "work", tmp_path / "store"
    (work / ".checkpoints").mkdir(parents=True)
    r = run_cli("status", "--store", str(store), cwd=work, env=sidecar_env())
    assert r.returncode == 0, r.stderr
    assert not store.exists()


@pytest.mark.azure
def test_status_on_a_missing_container_creates_nothing(tmp_path, azurite):
    target = new_target(azurite, "status")
    work = tmp_path / "work"
    (work / ".checkpoints").mkdir(parents=True)
    (work / ".checkpoints" / "a.json").write_text("{}")
    r = run_cli("status", "--store", target.store_url, cwd=work, env=target.env())
    assert r.returncode == 1, r.stderr  # a.json is not in the (empty) store
    assert "a.json" in r.stdout

    async def containers() -> list[str]:
        async with BlobServiceClient.from_connection_string(target.conn) as svc:
            return [c.name async for c in svc.list_containers()]

    assert target.container not in anyio.run(containers)
