"""Secrets never leak, and restored files never get dangerous modes.

``sync`` (debug logs, with /metrics, /readyz and /livez read while it runs), ``status`` (text and
JSON) and ``restore`` run against Azurite with a connection string holding the real key, with a SAS
in the store URL, with a wrong key and with a wrong SAS signature. Every byte they print, log or
serve is searched for the key, the signature and the whole credential (raw and URL-encoded).
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from datetime import datetime, timedelta, timezone
from urllib.parse import quote, unquote

import anyio
import pytest
from azure.storage.blob import ContainerSasPermissions, generate_container_sas
from azure.storage.blob.aio import BlobServiceClient

from support import Sidecar, disk_tree, run_cli, sidecar_env, write_atomic
from tests.azurite import DEV_ACCOUNT, DEV_KEY, connection_string
from tests.faults.faultkit import http_get, new_target, start_with_http, wait_converged_azure

pytestmark = [pytest.mark.faults, pytest.mark.azure]


def forms(*secrets: str) -> list[str]:
    out = set()
    for s in secrets:
        for v in (s, quote(s, safe=""), unquote(s), quote(unquote(s), safe="")):
            if len(v) >= 8:
                out.add(v)
    return sorted(out, key=len)


def assert_clean(outputs: dict[str, str], *secrets: str) -> None:
    for where, text in outputs.items():
        for s in forms(*secrets):
            assert s not in text, f"a credential ({s[:4]}...) appears in {where}"


def make_container(target) -> None:
    async def go() -> None:
        async with BlobServiceClient.from_connection_string(target.conn) as svc:
            await svc.create_container(target.container)

    anyio.run(go)


def sas_for(container: str, *, key: str = DEV_KEY) -> str:
    return generate_container_sas(
        DEV_ACCOUNT, container, account_key=key,
        permission=ContainerSasPermissions(read=True, add=True, create=True, write=True, delete=True, list=True),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
    )


def exercise(work, store_url: str, env: dict[str, str], target=None) -> dict[str, str]:
    """Run sync (with HTTP), status and restore; everything they printed, logged and served.
    With ``target`` the credentials work (and the store is checked), without they must not."""
    expect_ok = target is not None
    out: dict[str, str] = {}
    cps = work / ".checkpoints"
    env = {**env, "SIDECAR_LOG_LEVEL": "debug"}
    if expect_ok:
        sc, base = start_with_http(work, "--store", store_url, env=env)
        try:
            for i in range(5):
                write_atomic(cps / "ctx" / f"{i}.json", os.urandom(300))
            wait_converged_azure(target, cps, 30)
            for path in ("/metrics", "/readyz", "/livez"):
                out[f"GET {path}"] = http_get(base, path)[1]
            assert sc.stop() == 0
        finally:
            sc.kill()
        out["sync log"] = sc.log()
    else:
        sc = Sidecar(work, "sync", "--store", store_url, "--http-addr", "127.0.0.1:0", env=env)
        code = sc.proc.wait(60)
        sc.logf.close()
        out["sync log"] = sc.log()
        assert code == 1, out["sync log"][-2000:]
        assert "cannot reach the store" in out["sync log"] and "Traceback" not in out["sync log"]
    for args in (("status",), ("status", "--json")):
        r = run_cli(*args, "--store", store_url, cwd=work, env=env)
        out[" ".join(args)] = r.stdout + r.stderr
        assert r.returncode == (0 if expect_ok else 1), out[" ".join(args)]
    fresh = work.parent / f"fresh-{len(os.listdir(work.parent))}"
    fresh.mkdir()
    r = run_cli("restore", "--store", store_url, cwd=fresh, env=env)
    out["restore"] = r.stdout + r.stderr
    assert r.returncode == (0 if expect_ok else 1), out["restore"]
    if expect_ok:
        assert disk_tree(fresh / ".checkpoints") == disk_tree(cps)
    return out


def no_azure_env(**extra: str) -> dict[str, str]:
    """The test environment without any ambient Azure credential, plus ``extra``."""
    return {**{k: v for k, v in sidecar_env().items() if not k.startswith("AZURE_")}, **extra}


def test_connection_string_key_never_printed(azurite, tmp_path):
    target = new_target(azurite, "secret-conn")
    work = tmp_path / "work"
    work.mkdir()
    try:
        out = exercise(work, target.store_url, target.env(), target)
        assert_clean(out, DEV_KEY, target.conn)
    finally:
        target.drop()


def test_sas_in_the_store_url_never_printed(azurite, tmp_path):
    target = new_target(azurite, "secret-sas")
    make_container(target)
    sas = sas_for(target.container)
    sig = [p.split("=", 1)[1] for p in sas.split("&") if p.startswith("sig=")][0]
    work = tmp_path / "work"
    work.mkdir()
    try:
        out = exercise(work, f"{target.store_url}?{sas}", no_azure_env(), target)
        assert_clean(out, sig, sas)
    finally:
        target.drop()


def test_wrong_key_fails_in_one_line_without_printing_either_key(azurite, tmp_path):
    target = new_target(azurite, "secret-bad")
    make_container(target)
    bad = base64.b64encode(os.urandom(64)).decode()
    env = no_azure_env(AZURE_STORAGE_CONNECTION_STRING=connection_string(target.endpoint_url, key=bad))
    work = tmp_path / "work"
    work.mkdir()
    try:
        out = exercise(work, target.store_url, env)
        assert_clean(out, bad, DEV_KEY)
        assert "AZURE_STORAGE_CONNECTION_STRING" in out["restore"]
    finally:
        target.drop()


def test_wrong_sas_signature_fails_without_printing_it(azurite, tmp_path):
    target = new_target(azurite, "secret-badsas")
    make_container(target)
    sas = sas_for(target.container, key=base64.b64encode(os.urandom(64)).decode())  # signed with a wrong key
    sig = [p.split("=", 1)[1] for p in sas.split("&") if p.startswith("sig=")][0]
    work = tmp_path / "work"
    work.mkdir()
    try:
        out = exercise(work, f"{target.store_url}?{sas}", no_azure_env())
        assert_clean(out, sig, sas, DEV_KEY)
    finally:
        target.drop()


# -- modes of restored files ------------------------------------------------------------------------

def test_restored_modes_stored_or_private_never_world_writable(azurite, tmp_path):
    """Blob metadata gives the mode (set-id and world-write bits dropped); a blob without it (written
    by something else) is restored 0600; directories the restore creates are 0700."""
    target = new_target(azurite, "modes")

    def md(data: bytes, mode: str) -> dict[str, str]:
        return {"sidecar_sha256": hashlib.sha256(data).hexdigest(), "sidecar_mtime_ns": "1700000000000000000",
                "sidecar_mode": mode}

    blobs = {
        ".checkpoints/a/stored-0640.json": (b"a", md(b"a", "640")),
        ".checkpoints/a/setuid-4777.json": (b"b", md(b"b", "4777")),
        ".checkpoints/b/c/world-0666.json": (b"c", md(b"c", "666")),
        ".checkpoints/b/foreign.json": (b"d", None),
    }

    async def seed() -> None:
        async with BlobServiceClient.from_connection_string(target.conn) as svc:
            c = svc.get_container_client(target.container)
            await c.create_container()
            for name, (data, meta) in blobs.items():
                await c.upload_blob(name, data, metadata=meta)

    try:
        anyio.run(seed)
        work = tmp_path / "work"
        work.mkdir()
        old = os.umask(0)  # the restore must not rely on the umask for safe modes
        try:
            r = run_cli("restore", "--store", target.store_url, cwd=work, env=target.env())
        finally:
            os.umask(old)
        assert r.returncode == 0, r.stderr
        cps = work / ".checkpoints"
        mode = lambda p: stat.S_IMODE(os.lstat(cps / p).st_mode)  # noqa: E731
        assert mode("a/stored-0640.json") == 0o640
        assert mode("a/setuid-4777.json") == 0o775
        assert mode("b/c/world-0666.json") == 0o664
        assert mode("b/foreign.json") == 0o600
        for d in ("", "a", "b", "b/c"):
            assert mode(d) == 0o700, d
        for p in cps.rglob("*"):
            assert not stat.S_IMODE(p.lstat().st_mode) & (stat.S_IWOTH | stat.S_ISUID | stat.S_ISGID), p
        assert (cps / "a/stored-0640.json").stat().st_mtime_ns == 1700000000000000000
    finally:
        target.drop()


def test_a_password_in_the_connection_strings_endpoint_is_never_printed(tmp_path):
    """``BlobEndpoint=http://user:password@host/...``: refused in one line, exit 2, and neither the
    password nor the key appears anywhere in what any command prints."""
    secret = "pw-" + base64.b64encode(os.urandom(9)).decode().replace("/", "x").replace("+", "y")
    conn = f"AccountName=devstoreaccount1;AccountKey={DEV_KEY};BlobEndpoint=http://me:{secret}@127.0.0.1:9/devstoreaccount1"
    work = tmp_path / "work"
    work.mkdir()
    env = no_azure_env(AZURE_STORAGE_CONNECTION_STRING=conn)
    store = ["--store", "http://127.0.0.1:9/devstoreaccount1/ckpt"]
    for command in (["restore", *store], ["status", *store], ["run", *store, "--", "true"]):
        r = run_cli(*command, cwd=work, env=env)
        out = r.stdout + r.stderr
        assert r.returncode == 2, out
        assert secret not in out and DEV_KEY not in out, out
        assert [ln for ln in r.stderr.splitlines() if not ln.startswith("{")] == [ln for ln in r.stderr.splitlines()
                                                                                  if "config error" in ln], out
        assert "Traceback" not in out
