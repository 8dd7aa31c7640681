"""What a merge (a disk with files but no record of this namespace) must leave alone.

Real ``run`` / ``sync`` processes against real files and the directory store:

* a stored object the restore refuses (too large) or sets aside (corrupt) is never overwritten
  by the local file found at its path (an image's stale copy): only once the host writes that
  file is it mirrored;
* a root named like a session namespace nested in this one never reads, writes or deletes that
  namespace's own records (``.sidecar/``, ``.sidecar-meta/``);
* a disk recorded by another namespace is refused (exit 2), one line naming both.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support import Sidecar, disk_tree, run_cli, sidecar_env, store_tree, wait_for, write_atomic

BIG = b'{"state": "' + b"x" * 6740 + b'"}\n'  # 6,756 bytes: above --max-file-size 1000
STALE = b"small-stale\n"


def _store_with_big(tmp_path: Path) -> dict[str, str]:
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"))
    old = tmp_path / "old"
    write_atomic(old / ".checkpoints" / "c" / "big.json", BIG)
    write_atomic(old / ".checkpoints" / "c" / "s.json", b"small")
    r = run_cli("run", "--", "true", cwd=old, env=env)
    assert r.returncode == 0, r.stderr
    return env


def _corrupt(path: Path) -> None:
    st = path.stat()
    with open(path, "r+b") as f:  # bit rot: same size, same mtime, other bytes
        f.write(b"B")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("why", ["too_large", "corrupt"])
def test_a_refused_stored_file_is_not_overwritten_by_the_new_disks_stale_copy(tmp_path, why):
    env = _store_with_big(tmp_path)
    stored = tmp_path / "store" / ".checkpoints" / "c" / "big.json"
    if why == "too_large":
        args = ["--max-file-size", "1000"]
    else:
        _corrupt(stored)
        env["SIDECAR_RESTORE_CORRUPT"] = "skip"
        args = []
    before = stored.read_bytes()
    new = tmp_path / "new"
    write_atomic(new / ".checkpoints" / "c" / "big.json", STALE)  # the image's stale copy
    r = run_cli("run", *args, "--", "true", cwd=new, env=env)
    assert r.returncode == 0, r.stderr
    assert stored.read_bytes() == before, "the stale local copy was uploaded over the stored object"
    assert (new / ".checkpoints" / "c" / "big.json").read_bytes() == STALE


def test_once_the_host_writes_a_refused_files_path_it_is_mirrored(tmp_path):
    env = _store_with_big(tmp_path)
    env["SIDECAR_MAX_FILE_SIZE"] = "1000"
    new = tmp_path / "new"
    write_atomic(new / ".checkpoints" / "c" / "big.json", STALE)
    sc = Sidecar(new, "sync", env=env)
    try:
        sc.wait_event("ready", timeout=30)
        assert store_tree(tmp_path / "store")["c/big.json"] == BIG
        write_atomic(new / ".checkpoints" / "c" / "big.json", b"the host's own\n")
        wait_for(lambda: store_tree(tmp_path / "store")["c/big.json"] == b"the host's own\n", timeout=30,
                 what="the host's write mirrored")
    finally:
        assert sc.stop() == 0, sc.log()[-3000:]


def test_a_root_named_like_a_nested_namespace_leaves_its_records_alone(tmp_path):
    store = tmp_path / "store"
    session = tmp_path / "session"
    write_atomic(session / ".checkpoints" / "a.json", b"the session's")
    r = run_cli("run", "--", "true", cwd=session, env=sidecar_env(SIDECAR_STORE=str(store), SIDECAR_PREFIX="a/s1"))
    assert r.returncode == 0, r.stderr
    nested = store / "a" / "s1"
    records = {k: v for k, v in disk_tree(nested).items() if k.startswith((".sidecar/", ".sidecar-meta/"))}
    assert ".sidecar/owner" in records
    before = disk_tree(nested)

    work = tmp_path / "work"
    write_atomic(work / "s1" / "mine.json", b"the root's own")
    env = sidecar_env(SIDECAR_STORE=str(store), SIDECAR_PREFIX="a", SIDECAR_ROOTS="s1")
    sc = Sidecar(work, "sync", env=env)
    sc.wait_event("ready", timeout=30)
    write_atomic(work / "s1" / ".sidecar" / "owner", b"forged")  # the host writes one: never uploaded
    write_atomic(work / "s1" / "later.json", b"later")
    wait_for(lambda: (nested / "later.json").exists(), timeout=30, what="later.json mirrored")
    assert sc.stop() == 0, sc.log()[-3000:]
    assert not (work / "s1" / ".sidecar-meta").exists()
    assert (work / "s1" / ".sidecar" / "owner").read_bytes() == b"forged"
    after = disk_tree(nested)
    assert {k: after.get(k) for k in records} == records, "the nested namespace's records were touched"
    assert after == {**before, "mine.json": b"the root's own", "later.json": b"later"}
    warned = [e for e in sc.events() if e.get("event") == "root_is_namespace"]
    assert len(warned) == 1 and warned[0]["level"] == "warning", warned


def test_a_disk_recorded_by_another_namespace_is_refused_in_one_line(tmp_path):
    work = tmp_path / "work"
    write_atomic(work / ".checkpoints" / "mine.json", b"ns1's")
    env1 = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"), SIDECAR_PREFIX="ns1")
    assert run_cli("run", "--", "true", cwd=work, env=env1).returncode == 0
    env2 = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"), SIDECAR_PREFIX="ns2")
    r = run_cli("run", "--", "true", cwd=work, env=env2)
    assert r.returncode == 2, r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if "refusing to start" in ln]
    assert f"namespace 'ns1' of file://{tmp_path / 'store' / 'ns1'}" in line, line
    assert f"this sidecar mirrors 'ns2' of file://{tmp_path / 'store' / 'ns2'}" in line, line
    assert not (tmp_path / "store" / "ns2" / ".checkpoints").exists(), "ns1's file entered ns2"
    # the line escapes what the record names (it is read from a disk, untrusted)
    (work / ".checkpoints" / ".sidecar-lineage").write_text('{"store": "evil\\nforged", "namespace": "x\\u001b[2J"}')
    r = run_cli("restore", cwd=work, env={**env2, "SIDECAR_LOG_FORMAT": "text"})
    assert r.returncode == 2, r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if "refusing to start" in ln]
    assert "evil\\nforged" in line and "x\\x1b[2J" in line and "\x1b" not in line, line
