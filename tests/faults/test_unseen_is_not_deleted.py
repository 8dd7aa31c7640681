"""What cannot be read or placed is never taken for deleted; what is not mirrored is said.

* a stored file the restore refuses (a directory stands at its path; on Azure, ``a`` beside
  ``a/b``) stays in the store;
* a subdirectory the sidecar cannot read keeps its stored files; a root it cannot read makes it
  unready; ``status`` is not "in sync" in either case;
* a file whose path is too long for any store is reported, by the log and by ``status``;
* a corrupt stored object fails the restore by default, and ``SIDECAR_RESTORE_CORRUPT=skip``
  starts without it, keeping it in the store.

The sidecar runs as root here, and root reads everything: "cannot read" is made real by running
it without the capabilities that bypass file permissions (``support.WITHOUT_DAC``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import pytest

from support import WITHOUT_DAC, Sidecar, disk_tree, json_lines, run_cli, sidecar_env, store_tree, wait_for, write_atomic
from tests.faults.faultkit import http_get

pytestmark = pytest.mark.faults


def mirror(work: Path, env: dict[str, str], files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        write_atomic(work / ".checkpoints" / rel, data)
    r = run_cli("run", "--", "true", cwd=work, env=env)
    assert r.returncode == 0, r.stderr


def store_env(kind: str, tmp_path: Path, request) -> tuple[dict[str, str], callable, object]:
    if kind == "azure":
        from tests.faults.faultkit import new_target

        target = new_target(request.getfixturevalue("azurite"), "unseen")
        env = target.env(SIDECAR_STORE=target.store_url)
        return env, lambda: target.tree(".checkpoints"), target
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"))
    return env, lambda: store_tree(tmp_path / "store"), None


@pytest.mark.parametrize("kind", ["directory", pytest.param("azure", marks=pytest.mark.azure)])
def test_a_file_the_restore_refuses_stays_in_the_store(kind, tmp_path, request):
    env, stored, target = store_env(kind, tmp_path, request)
    try:
        old, new = tmp_path / "old", tmp_path / "new"
        old.mkdir()
        new.mkdir()
        mirror(old, env, {"a.json": b"refused at restore", "ctx/b.json": b"restored"})
        (new / ".checkpoints" / "a.json").mkdir(parents=True)  # a directory stands where the file goes
        sc = Sidecar(new, "sync", env=env)
        sc.wait_event("ready")
        assert sc.stop() == 0, sc.log()[-2000:]
        assert any(e.get("event") == "restore_refused_target" for e in sc.events())
        assert disk_tree(new / ".checkpoints") == {"ctx/b.json": b"restored"}
        assert stored() == {"a.json": b"refused at restore", "ctx/b.json": b"restored"}
    finally:
        if target is not None:
            target.drop()


@pytest.mark.azure
def test_on_azure_a_file_beside_a_directory_of_the_same_name_stays(tmp_path, request):
    """Blob names allow ``x`` and ``x/y`` at once; a disk holds only one of them."""
    from sidecar.store import make_store
    from sidecar.store.base import ObjectMeta
    from tests.faults.faultkit import new_target

    target = new_target(request.getfixturevalue("azurite"), "unseen")
    env = target.env(SIDECAR_STORE=target.store_url)

    async def seed() -> None:
        store = make_store(target.store_url, env={"AZURE_STORAGE_CONNECTION_STRING": target.conn})
        await store.open()
        try:
            for key, data in ((".checkpoints/x", b"a file"), (".checkpoints/x/y", b"a file below it")):
                await store.put(key, data, ObjectMeta.of(data, 1_700_000_000_000_000_000, 0o600))
        finally:
            await store.aclose()

    try:
        anyio.run(seed)
        work = tmp_path / "w"
        work.mkdir()
        sc = Sidecar(work, "sync", env=env)
        sc.wait_event("ready")
        assert sc.stop() == 0, sc.log()[-2000:]
        assert len(disk_tree(work / ".checkpoints")) == 1  # one of them fits
        assert target.tree(".checkpoints") == {"x": b"a file", "x/y": b"a file below it"}
    finally:
        target.drop()


def test_an_unreadable_directory_keeps_its_stored_files(tmp_path):
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"))
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    files = {"top.json": b"top", "alice/ctx/x.json": b"alice's"}
    mirror(old, env, files)

    sc = Sidecar(new, "sync", env=env, wrap=WITHOUT_DAC)
    sc.wait_event("ready")
    assert disk_tree(new / ".checkpoints") == files
    os.chmod(new / ".checkpoints" / "alice", 0)  # another user's now, say
    try:
        assert sc.stop() == 0, sc.log()[-2000:]  # the final rescan cannot read alice/
        assert store_tree(tmp_path / "store") == files
        [e] = [e for e in sc.events() if e.get("event") == "directory_unreadable"]
        assert e["path"] == ".checkpoints/alice" and "ermission denied" in e["error"]
        r = run_cli("status", cwd=new, env=env, wrap=WITHOUT_DAC)
        assert r.returncode == 1 and "unreadable dir   .checkpoints/alice" in r.stdout, r.stdout
        assert "missing locally  .checkpoints/alice" not in r.stdout
    finally:
        os.chmod(new / ".checkpoints" / "alice", 0o700)


def test_an_unreadable_root_makes_the_sidecar_unready(tmp_path):
    work = tmp_path / "w"
    (work / ".checkpoints").mkdir(parents=True)
    write_atomic(work / ".checkpoints" / "x.json", b"the host's, unreadable to us")
    os.chmod(work / ".checkpoints", 0)
    # no periodic rescan within the test: readable again is seen as such at once (issue #34, item 6)
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"), SIDECAR_RECONCILE_INTERVAL="3600")
    sc = Sidecar(work, "sync", "--http-addr", "127.0.0.1:0", env=env, wrap=WITHOUT_DAC)
    try:
        base = f"http://{sc.wait_event('http_listening')['addr']}"
        sc.wait_event("directory_unreadable")
        code, body = wait_for(lambda: (r := http_get(base, "/readyz")) and r[0] == 503 and "cannot read" in r[1] and r,
                              15, "/readyz to say why it is not ready")
        assert f"cannot read {work / '.checkpoints'}" in body
        r = run_cli("status", "--json", cwd=work, env=env, wrap=WITHOUT_DAC)
        assert r.returncode == 1 and json.loads(r.stdout)["roots"][".checkpoints"]["unreadable"] == [".checkpoints"]
        os.chmod(work / ".checkpoints", 0o700)  # fixed: ready again, not at the next periodic rescan
        wait_for(lambda: http_get(base, "/readyz")[0] == 200, 15, "/readyz to recover with the root", sc.log)
    finally:
        os.chmod(work / ".checkpoints", 0o700)
        sc.stop()


def test_a_path_too_long_for_any_store_is_reported(tmp_path):
    work = tmp_path / "w"
    deep = work / ".checkpoints" / ("d" * 250) / ("e" * 250) / ("f" * 250) / ("g" * 250) / "h"
    write_atomic(deep / "x.json", b"cannot be stored")
    write_atomic(work / ".checkpoints" / "ok.json", b"fine")
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"))
    sc = Sidecar(work, "sync", env=env)
    sc.wait_event("ready")
    assert sc.stop() == 0
    [e] = [e for e in sc.events() if e.get("event") == "file_unstorable"]
    assert e["path"].endswith("/x.json")
    r = run_cli("status", cwd=work, env=env)
    assert r.returncode == 1 and "NOT in sync" in r.stdout and "name too long" in r.stdout, r.stdout


def test_a_corrupt_object_fails_the_restore_unless_skipped(tmp_path):
    # no restore points: the rotten per-file object is the only copy (a point would restore it)
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"), SIDECAR_RESTORE_POINT_INTERVAL="0")
    old = tmp_path / "old"
    old.mkdir()
    mirror(old, env, {"good.json": b"good", "bad.json": b"bits that will rot"})
    data = tmp_path / "store" / ".checkpoints" / "bad.json"
    st = data.stat()
    with open(data, "r+b") as f:  # bit rot: same size, same mtime, other bytes
        f.write(b"B")
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    r = run_cli("restore", cwd=fresh, env=env)
    assert r.returncode == 1
    [line] = [ln for ln in r.stderr.splitlines() if not json_lines(ln)]
    assert ".checkpoints/bad.json" in line and "SIDECAR_RESTORE_CORRUPT=skip" in line, line

    skip = {**env, "SIDECAR_RESTORE_CORRUPT": "skip"}
    sc = Sidecar(fresh, "sync", env=skip)
    sc.wait_event("ready")
    assert disk_tree(fresh / ".checkpoints") == {"good.json": b"good"}
    assert sc.stop() == 0
    assert any(e.get("event") == "restore_corrupt_object_quarantined" and e["path"] == ".checkpoints/bad.json"
               for e in sc.events())
    assert data.exists()  # quarantined in place: never deleted by the sync


@pytest.mark.parametrize("why", ["too_large", "corrupt"])
def test_what_a_restore_refused_stays_stored_across_restarts_on_the_same_disk(tmp_path, why):
    """The sidecar restarts beside the host's disk (a sidecar container restarted, or sync after a
    restore init container): the root holds files now, so nothing is restored, and the object the
    first restore refused is still not on disk. Its absence is not a deletion then either. No
    restore points: the refused per-file object is the only copy."""
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"), SIDECAR_RESTORE_POINT_INTERVAL="0")
    old = tmp_path / "old"
    old.mkdir()
    mirror(old, env, {"big.bin": b"x" * 5000, "s.json": b"small"})
    if why == "too_large":
        env["SIDECAR_MAX_FILE_SIZE"] = "1000"
    else:
        env["SIDECAR_RESTORE_CORRUPT"] = "skip"
        data = tmp_path / "store" / ".checkpoints" / "big.bin"
        st = data.stat()
        with open(data, "r+b") as f:
            f.write(b"y")
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    new = tmp_path / "new"
    new.mkdir()
    for start in (1, 2):
        sc = Sidecar(new, "sync", env=env)
        sc.wait_event("ready")
        assert sc.stop() == 0, sc.log()[-2000:]
        assert disk_tree(new / ".checkpoints") == {"s.json": b"small"}, start
        assert "big.bin" in store_tree(tmp_path / "store"), f"deleted on start {start}:\n{sc.log()[-2000:]}"
    # the host writes that file itself: mirrored as usual from then on
    write_atomic(new / ".checkpoints" / "big.bin", b"the host's own")
    assert run_cli("run", "--", "true", cwd=new, env=env).returncode == 0
    assert store_tree(tmp_path / "store")["big.bin"] == b"the host's own"
