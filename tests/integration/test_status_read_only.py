"""``status``, ``history``, ``restore`` and ``release`` only read: pointed at a store that does not
exist, they create nothing. Every command but a plain ``restore`` exits 1 there, one line naming
the store (issue #34); a plain ``restore`` (an init container's, before the first ``sync``
creates the store) starts empty, exit 0, and says so in one warning line."""

from __future__ import annotations

import os
import subprocess

import anyio
import pytest
from azure.storage.blob.aio import BlobServiceClient

from support import json_lines, run_cli, sidecar_cmd, sidecar_env
from tests.faults.faultkit import new_target


def assert_not_there(r: subprocess.CompletedProcess, store: str) -> None:
    """Exit 1, and one stderr line naming the store."""
    assert r.returncode == 1, (r.stdout, r.stderr)
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("checkpoint-sidecar: error: ") and " is not there: check SIDECAR_STORE" in line, line
    assert store in line and "Traceback" not in line


def test_status_on_a_missing_directory_store_is_one_line_and_creates_nothing(tmp_path):
    work, store = tmp_path / "work", tmp_path / "store"
    (work / ".checkpoints").mkdir(parents=True)
    r = run_cli("status", "--store", str(store), cwd=work, env=sidecar_env())
    assert_not_there(r, str(store))
    assert r.stdout == "" and not store.exists()


@pytest.mark.parametrize("args", [("history",), ("restore", "--as-of", "30m"), ("restore", "--as-of", "2026-01-02T03:04:05Z"),
                                  ("release",)], ids=lambda a: " ".join(a))
def test_a_missing_directory_store_is_one_line_and_exit_1(tmp_path, args):
    work, store = tmp_path / "work", tmp_path / "store"
    work.mkdir()
    r = run_cli(*args, "--store", str(store), "--prefix", "agents/s1", cwd=work, env=sidecar_env())
    assert_not_there(r, str(store))
    assert not store.exists()


@pytest.mark.azure
def test_status_on_a_missing_container_creates_nothing(tmp_path, azurite):
    target = new_target(azurite, "status")
    work = tmp_path / "work"
    (work / ".checkpoints").mkdir(parents=True)
    (work / ".checkpoints" / "a.json").write_text("{}")
    r = run_cli("status", "--store", target.store_url, cwd=work, env=target.env())
    assert_not_there(r, target.container)  # never "a.json pending upload" to a store that is not there

    async def containers() -> list[str]:
        async with BlobServiceClient.from_connection_string(target.conn) as svc:
            return [c.name async for c in svc.list_containers()]

    assert target.container not in anyio.run(containers)


def test_restore_from_a_missing_directory_store_creates_nothing(tmp_path):
    work, store = tmp_path / "work", tmp_path / "store"
    work.mkdir()
    r = run_cli("restore", "--store", str(store), cwd=work, env=sidecar_env())
    assert r.returncode == 0, r.stderr
    assert not store.exists()
    (said,) = [e for e in json_lines(r.stderr) if e.get("event") == "store_not_there"]
    assert str(store) in said["store"] and "the first sync or run creates it" in said["detail"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_status_that_cannot_write_its_report_says_so_in_one_line(tmp_path):
    work = tmp_path / "work"
    (work / ".checkpoints").mkdir(parents=True)
    (tmp_path / "store").mkdir()
    with open("/dev/full", "w") as full:
        r = subprocess.run(sidecar_cmd("status", "--store", str(tmp_path / "store")), cwd=work, env=sidecar_env(),
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == ["checkpoint-sidecar: error: cannot write the report: No space left on device"]


def test_a_root_that_is_a_file_is_a_config_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    r = run_cli("sync", "--roots", "afile", "--store", str(tmp_path / "store"), cwd=tmp_path, env=sidecar_env())
    assert r.returncode == 2
    assert "afile is not a directory" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.azure
def test_restore_from_a_missing_container_creates_nothing(tmp_path, azurite):
    target = new_target(azurite, "restore")
    work = tmp_path / "work"
    work.mkdir()
    env = target.env(FOUNDRY_AGENT_NAME="agent", FOUNDRY_AGENT_SESSION_ID="s1")  # reads the owner marker too
    r = run_cli("restore", "--store", target.store_url, cwd=work, env=env)
    assert r.returncode == 0, r.stderr
    assert [e for e in json_lines(r.stderr) if e.get("event") == "store_not_there"], r.stderr

    async def containers() -> list[str]:
        async with BlobServiceClient.from_connection_string(target.conn) as svc:
            return [c.name async for c in svc.list_containers()]

    assert target.container not in anyio.run(containers)
