"""Hostile and odd input: stored names escaping a root (Azurite), files over the size limit,
unreadable files, names that are not UTF-8 or very long, a full disk during restore.

Covered elsewhere and reused (see docs/RELIABILITY.md): hostile names through the restore with an
in-memory store (tests/integration/test_restore.py), symlinks never followed on upload
(tests/integration/test_sync.py::test_symlinks_are_never_followed) nor written through on restore
(tests/integration/test_restore.py::test_symlink_inside_root_is_never_written_through), a root
deleted and re-created while syncing (tests/integration/test_sync.py::test_roots_created_late_and_recreated).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import pytest
from azure.storage.blob.aio import BlobServiceClient

from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore
from support import (
    Sidecar,
    disk_tree,
    json_lines,
    run_cli,
    seed_directory_store,
    sidecar_env,
    store_tree,
    wait_for,
    write_atomic,
)
from tests.faults.faultkit import events, metrics, new_target, start_with_http

pytestmark = pytest.mark.faults


# -- stored names escaping a root, in Azurite ------------------------------------------------------

@pytest.mark.azure
def test_hostile_blob_names_in_azurite_are_refused_on_restore(azurite, tmp_path):
    """Azure turns ``\\`` into ``/`` in blob names, so a backslash is how ``..`` gets into one (the
    SDK's URL handling would resolve a literal ``/../``)."""
    target = new_target(azurite, "hostile")
    uploads = [
        "p/.checkpoints/..\\..\\escaped.json",
        "p/.checkpoints/ctx/..\\..\\..\\escaped2.json",
        "p//abs.json",
        "p/.checkpoints//empty-component.json",
        "p/.checkpoints/.\\dot.json",
        "p/..\\outside.json",
        "p/.checkpoints/ctx/good.json",
    ]

    async def seed() -> list[str]:
        async with BlobServiceClient.from_connection_string(target.conn) as svc:
            c = svc.get_container_client(target.container)
            await c.create_container()
            for name in uploads:
                await c.upload_blob(name, b"evil" if "good" not in name else b"good", overwrite=True)
            return [b.name async for b in c.list_blobs(name_starts_with="p/")]

    try:
        stored = anyio.run(seed)
        assert "p/.checkpoints/../../escaped.json" in stored  # what the service made of the backslashes
        hostile = sorted(n[2:] for n in stored if not n.endswith("good.json"))
        work = tmp_path / "deep" / "work"
        work.mkdir(parents=True)
        r = run_cli("restore", "--store", target.store_url, "--prefix", "p", cwd=work, env=target.env())
        assert r.returncode == 0, r.stderr
        refused = sorted(e["path"] for e in json_lines(r.stderr) if e.get("event") == "restore_refused_name")
        assert refused == hostile
        assert disk_tree(work) == {".checkpoints/ctx/good.json": b"good"}
        names = {f for _d, _s, files in os.walk(tmp_path) for f in files}
        assert not names & {"escaped.json", "escaped2.json", "abs.json", "outside.json", "dot.json",
                            "empty-component.json"}
        r = run_cli("status", "--json", "--store", target.store_url, "--prefix", "p", cwd=work, env=target.env())
        assert sorted(json.loads(r.stdout)["unsafe_stored_names"]) == hostile
    finally:
        target.drop()


# -- files over --max-file-size --------------------------------------------------------------------

def test_files_over_max_file_size_are_skipped_logged_and_counted(work):
    work, store = work
    cps = work / ".checkpoints"
    sc, base = start_with_http(work, "--store", str(store), "--max-file-size", "1000")
    try:
        write_atomic(cps / "ctx" / "small.json", b"s" * 500)
        write_atomic(cps / "ctx" / "big.json", b"b" * 5000)
        wait_for(lambda: store_tree(store) == {"ctx/small.json": b"s" * 500}, 10, "the small file")
        ev = sc.wait_event("file_too_large")
        assert "ctx/big.json" in ev["path"] and "5000 bytes > limit 1000" in ev["path"]
        wait_for(lambda: metrics(base).get("checkpoint_sidecar_skipped_files_total{reason=too_large}", 0) >= 1,
                 10, "skipped_files_total{reason=too_large}")
        write_atomic(cps / "ctx" / "big.json", b"b" * 800)  # back under the limit: mirrored
        wait_for(lambda: store_tree(store) == disk_tree(cps), 10, "the shrunk file")
        assert sc.stop() == 0
    finally:
        sc.kill()


def test_a_skipped_file_is_not_reported_again_by_every_reconcile(work):
    work, store = work
    cps = work / ".checkpoints"
    write_atomic(cps / "ctx" / "big.json", b"b" * 5000)
    sc, base = start_with_http(work, "--store", str(store), "--max-file-size", "1000", "--reconcile-interval", "0.2")
    try:
        sc.wait_event("file_too_large")
        n = metrics(base).get("checkpoint_sidecar_reconciles_total{kind=local}", 0)
        wait_for(lambda: metrics(base).get("checkpoint_sidecar_reconciles_total{kind=local}", 0) >= n + 3, 15,
                 "three periodic reconciles")
        m = metrics(base)
        assert not events(sc, "reconcile_found_changes"), events(sc, "reconcile_found_changes")[:2]
        assert m.get("checkpoint_sidecar_reconcile_fixes_total", 0) == 0
        assert m["checkpoint_sidecar_skipped_files_total{reason=too_large}"] == 1
    finally:
        sc.kill()


# -- unreadable files (the sidecar without the capabilities that let root read anything) ----------

#: setpriv arguments: root, but with every capability dropped from the bounding and inheritable
#: sets, so the exec'd sidecar has none and file permissions apply to it as to any owner. (Running
#: it as another uid instead fails when the checkout sits in a 0700 directory such as mktemp's.)
NO_CAPS = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]


class Unprivileged(Sidecar):
    """``sync`` run through ``setpriv`` with no capabilities: a mode-0000 file is unreadable to it."""

    def __init__(self, cwd: Path, *args: str, env: dict[str, str]):
        self.cwd = Path(cwd)
        self.log_path = self.cwd.parent / f"sidecar-{time.monotonic_ns()}.log"
        self.logf = open(self.log_path, "wb")  # noqa: SIM115  (the child's log while it runs)
        self.proc = subprocess.Popen(
            [*NO_CAPS, sys.executable, "-m", "sidecar", *args],
            cwd=cwd, env=env, stdout=self.logf, stderr=subprocess.STDOUT, start_new_session=True,
        )


def test_unreadable_file_is_skipped_logged_and_counted():
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the sidecar without capabilities "
                    "(with CAP_DAC_OVERRIDE root reads every file whatever its mode)")
    base = Path(tempfile.mkdtemp(prefix="sidecar-unpriv-"))
    sc = None
    try:
        work, store = base / "work", base / "store"
        cps = work / ".checkpoints"
        store.mkdir()
        write_atomic(cps / "ctx" / "readable.json", b"ok")
        write_atomic(cps / "ctx" / "secret.json", b"nobody may read this")
        os.chmod(cps / "ctx" / "secret.json", 0o000)
        probe = subprocess.run([*NO_CAPS, sys.executable, "-c", "open(__import__('sys').argv[1]).read()",
                                str(cps / "ctx" / "secret.json")], capture_output=True, text=True)
        if probe.returncode == 0 or "Permission denied" not in probe.stderr:
            pytest.skip(f"dropping capabilities did not make a mode-0000 file unreadable: {probe.stderr.strip()[-200:]}")
        sc = Unprivileged(work, "sync", "--store", str(store), "--http-addr", "127.0.0.1:0",
                          env=sidecar_env(HOME=str(base)))
        addr = sc.wait_event("http_listening")["addr"]
        sc.wait_event("ready")
        wait_for(lambda: store_tree(store) == {"ctx/readable.json": b"ok"}, 10, "the readable file")
        ev = sc.wait_event("file_unreadable")
        assert "ctx/secret.json" in ev["path"] and "Permission denied" in ev["path"]
        wait_for(lambda: metrics(f"http://{addr}").get("checkpoint_sidecar_skipped_files_total{reason=unreadable}", 0) >= 1,
                 10, "skipped_files_total{reason=unreadable}")
        assert not events(sc, "operation_failed") and not events(sc, "store_retry")
        assert sc.stop() == 0
        sc = None
    finally:
        if sc is not None:
            sc.kill()
        shutil.rmtree(base, ignore_errors=True)


# -- names: not UTF-8, backslashes, very long ------------------------------------------------------

NON_UTF8 = b"\xff\xfe.json"
LONG_250 = "L" * 245 + ".json"  # 250 bytes
LONG_255 = "M" * 250 + ".json"  # the most a file name may have


def odd_tree(cps: Path) -> None:
    write_atomic(cps / "ctx" / "plain.json", b"plain")
    write_atomic(cps / "ctx" / LONG_250, b"two hundred fifty")
    (cps / "ctx" / LONG_255).write_bytes(b"two hundred fifty-five")  # no room for a ".tmp" suffix
    write_atomic(cps / "ctx" / "back\\slash.json", b"backslash")
    fd = os.open(os.path.join(os.fsencode(cps / "ctx"), NON_UTF8), os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"not utf-8")
    os.close(fd)


def mirrorable(tree: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in tree.items() if "\\" not in k and os.fsencode(k).decode("utf-8", "replace") == k}


@pytest.mark.parametrize("kind", ["directory", pytest.param("azure", marks=pytest.mark.azure)])
def test_odd_names_long_mirrored_byte_exact_non_utf8_and_backslash_refused(kind, tmp_path, request):
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    if kind == "directory":
        store_url, env, target = str(tmp_path / "store"), sidecar_env(), None
        stored = lambda: store_tree(tmp_path / "store")  # noqa: E731
    else:
        target = new_target(request.getfixturevalue("azurite"), "names")
        store_url, env = target.store_url, target.env()
        stored = lambda: target.tree(".checkpoints")  # noqa: E731
    try:
        cps.mkdir(parents=True)
        sc, base = start_with_http(work, "--store", store_url, env=env)
        try:
            odd_tree(cps)  # while running: through the watcher
            expected = mirrorable(disk_tree(cps))
            assert set(expected) == {"ctx/plain.json", f"ctx/{LONG_250}", f"ctx/{LONG_255}"}
            wait_for(lambda: stored() == expected, 20, "the mirrorable names stored byte-exact")
            refusals = wait_for(lambda: len(events(sc, "unmirrorable_name")) >= 2 and events(sc, "unmirrorable_name"),
                                10, "one warning per refused name")
            text = json.dumps(refusals)
            assert "\\\\xff\\\\xfe.json" in text and "not valid UTF-8" in text and "backslash" in text
            m = metrics(base)
            assert not any(k.startswith("checkpoint_sidecar_failures_total") for k in m), \
                {k: v for k, v in m.items() if "failures" in k}
            assert m["checkpoint_sidecar_store_degraded"] == 0
            assert sc.stop() == 0
        finally:
            sc.kill()
        # a fresh start (names found by the scan, not by events) agrees and stays quiet
        sc = Sidecar(work, "sync", "--store", store_url, env=env)
        sc.wait_event("ready")
        start = sc.wait_event("reconcile_start")
        assert start["upload"] == 0 and start["delete"] == 0, start
        assert sc.stop() == 0
        # restored byte-exact into an empty root
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        r = run_cli("restore", "--store", store_url, cwd=fresh, env=env)
        assert r.returncode == 0, r.stderr
        assert disk_tree(fresh / ".checkpoints") == expected
    finally:
        if target is not None:
            target.drop()


def test_directory_store_holding_a_non_utf8_name_is_refused_on_restore(tmp_path):
    """A name no sync stores today (an older version's directory store): refused, one line."""
    store = tmp_path / "store"

    async def seed() -> None:
        s = DirectoryStore(str(store))
        await s.open()
        await s.put(".checkpoints/ctx/good.json", b"good", ObjectMeta.of(b"good", 1, 0o600))

    anyio.run(seed)
    with open(os.path.join(os.fsencode(store / ".checkpoints" / "ctx"), NON_UTF8), "wb") as f:
        f.write(b"legacy")
    work = tmp_path / "work"
    work.mkdir()
    r = run_cli("restore", "--store", str(store), cwd=work)
    assert r.returncode == 0, r.stderr
    refused = [e for e in json_lines(r.stderr) if e.get("event") == "restore_refused_name"]
    assert len(refused) == 1 and refused[0]["path"] == ".checkpoints/ctx/\\xff\\xfe.json"
    assert "not valid UTF-8" in refused[0]["reason"]
    assert disk_tree(work) == {".checkpoints/ctx/good.json": b"good"}


# -- disk full during restore ---------------------------------------------------------------------

def test_disk_full_during_restore_is_one_clear_line_and_leaves_no_partial_file(tmp_path):
    store = tmp_path / "store"
    files = {f".checkpoints/ctx{i % 3}/{i:02}.json": os.urandom(256 * 1024) for i in range(16)}  # 4 MiB
    seed_directory_store(store, files)
    work = tmp_path / "work"
    target = work / ".checkpoints"
    target.mkdir(parents=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs as the restore target")
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(target)], capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {m.stderr.strip()}")
    try:
        r = run_cli("restore", "--store", str(store), cwd=work)
        assert r.returncode == 1, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if "no space" in ln.lower()]
        assert len(lines) == 1 and lines[0].startswith("checkpoint-sidecar: error: restore failed: "), r.stderr
        assert "Traceback" not in r.stderr
        left = {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()}
        assert not [p for p in left if Path(p).name.startswith(".sidecar-restore-")], left
        present = disk_tree(target)
        assert 0 < len(present) < len(files)
        for rel, data in present.items():  # whatever is there is complete and right
            assert files[".checkpoints/" + rel] == data, f"partial file {rel}"
    finally:
        subprocess.run(["umount", str(target)], check=False)
        if os.path.ismount(target):
            subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_file_name_with_newlines_never_forges_status_lines(tmp_path):
    """``status`` lists pending names one per line: a name holding a newline and a fake verdict
    is printed escaped, on its own line, and cannot forge an 'in sync'."""
    from support import run_cli, sidecar_env

    work = tmp_path / "w"
    forged = "x.json\nin sync\n  missing locally  fake.json"
    (work / ".checkpoints").mkdir(parents=True)
    (work / ".checkpoints" / forged).write_bytes(b"pending")
    (tmp_path / "store").mkdir()  # an empty store: one that is not there is refused before any name is listed
    r = run_cli("status", cwd=work, env=sidecar_env(SIDECAR_STORE=str(tmp_path / "store")))
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "in sync" not in lines and lines[-1] == "NOT in sync", lines
    assert any(ln.strip() == "pending upload   .checkpoints/x.json\\nin sync\\n  missing locally  fake.json"
               for ln in lines), lines
    assert not any(ln.startswith("  missing locally") for ln in lines), lines
