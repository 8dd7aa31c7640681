"""The directory store in an unkind filesystem: paths that change kind, crash leftovers, symlinks
and special files planted inside it, and a full disk. Real ``sync``/``restore`` processes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time

import pytest

from support import Sidecar, disk_tree, json_lines, run_cli, sidecar_env, store_tree, wait_for, write_atomic

pytestmark = pytest.mark.faults


def test_a_path_that_turns_from_file_to_directory_and_back_converges(tmp_path):
    work, store = tmp_path / "w", tmp_path / "store"
    cps = work / ".checkpoints"
    work.mkdir()
    sc = Sidecar(work, "sync", env=sidecar_env(SIDECAR_STORE=str(store)))
    sc.wait_event("ready")
    write_atomic(cps / "a", b"a file")
    wait_for(lambda: store_tree(store) == {"a": b"a file"}, 15, "the file stored")
    (cps / "a").unlink()
    write_atomic(cps / "a" / "b", b"now a directory")
    wait_for(lambda: store_tree(store) == {"a/b": b"now a directory"}, 15, "the directory's file stored")
    (cps / "a" / "b").unlink()
    (cps / "a").rmdir()
    write_atomic(cps / "a", b"a file again")
    wait_for(lambda: store_tree(store) == {"a": b"a file again"}, 15, "the file stored again")
    assert sc.stop() == 0, sc.log()[-3000:]  # 0: nothing left pending (it was retried for ever)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert run_cli("restore", cwd=fresh, env=sidecar_env(SIDECAR_STORE=str(store))).returncode == 0
    assert disk_tree(fresh / ".checkpoints") == {"a": b"a file again"}


def test_a_crashed_writers_temp_files_are_removed(tmp_path):
    store = tmp_path / "store"
    for leftover in (store / ".checkpoints" / "ctx" / ".sidecar-tmp-0123456789ab",
                     store / ".sidecar-meta" / ".checkpoints" / ".sidecar-tmp-ba9876543210"):
        leftover.parent.mkdir(parents=True)
        leftover.write_bytes(b"x" * 100_000)
        crashed_at = time.time_ns() - 3600 * 10**9  # its writer died an hour ago (no lock on it)
        os.utime(leftover, ns=(crashed_at, crashed_at))
    work = tmp_path / "w"
    write_atomic(work / ".checkpoints" / "ctx" / "c.json", b"new")
    r = run_cli("run", "--", "true", cwd=work, env=sidecar_env(SIDECAR_STORE=str(store)))
    assert r.returncode == 0, r.stderr
    assert [p.name for p in store.rglob(".sidecar-tmp-*")] == []
    assert store_tree(store) == {"ctx/c.json": b"new"}


def test_a_symlink_planted_in_the_store_is_never_followed(tmp_path):
    store, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.json").write_bytes(b"not the store's")
    (store / ".checkpoints").mkdir(parents=True)
    os.symlink(outside, store / ".checkpoints" / "ctx")
    work = tmp_path / "w"
    write_atomic(work / ".checkpoints" / "ctx" / "c.json", b"must not land outside")
    write_atomic(work / ".checkpoints" / "ok.json", b"fine")
    sc = Sidecar(work, "sync", "--drain-timeout", "2", env=sidecar_env(SIDECAR_STORE=str(store)))
    sc.wait_event("ready")
    wait_for(lambda: any("refusing to follow the symlink" in str(e.get("error", "")) for e in sc.events()), 15,
             "the refusal")
    assert sc.stop() == 75  # the refused file stays pending, and the exit code says so
    assert sorted(p.name for p in outside.iterdir()) == ["precious.json"]
    assert (outside / "precious.json").read_bytes() == b"not the store's"
    assert (store / ".checkpoints" / "ok.json").read_bytes() == b"fine"


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_record_that_is_no_file_never_hangs_or_floods(tmp_path, kind):
    store = tmp_path / "store"
    src = tmp_path / "src"
    write_atomic(src / ".checkpoints" / "c.json", b"data")
    assert run_cli("run", "--", "true", cwd=src, env=sidecar_env(SIDECAR_STORE=str(store))).returncode == 0
    record = store / ".sidecar-meta" / ".checkpoints" / "c.json.json"
    record.unlink()
    if kind == "fifo":
        os.mkfifo(record)
    else:
        os.symlink("/dev/zero", record)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    env = sidecar_env(SIDECAR_STORE=str(store))
    r = run_cli("restore", cwd=fresh, env=env, timeout=30)  # a hang or a flood fails the timeout
    assert r.returncode == 0, r.stderr
    assert disk_tree(fresh / ".checkpoints") == {"c.json": b"data"}  # restored unverified
    assert [e["unverified"] for e in json_lines(r.stderr) if e.get("event") == "restore_done"] == [1]
    assert run_cli("status", cwd=fresh, env=env, timeout=30).returncode in (0, 1)


def test_a_full_store_recovers_within_seconds_of_space_returning(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs as the store")
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(store)], capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {m.stderr.strip()}")
    try:
        filler = store / "filler"
        with open(filler, "wb") as f, contextlib.suppress(OSError):  # leave the store no room
            f.write(b"\0" * (2 << 20))
        work = tmp_path / "w"
        work.mkdir()
        sc = Sidecar(work, "sync", env=sidecar_env(SIDECAR_STORE=str(store)))
        wait_for(lambda: sc.has_event("store_retry") or sc.has_event("ready"), 20, "the sidecar to start")
        write_atomic(work / ".checkpoints" / "c.json", os.urandom(64_000))
        wait_for(lambda: any("is full" in str(e.get("error", "")) for e in sc.events() if e.get("event") == "store_retry"),
                 20, "the store reported full")
        # the failures go on for a while, so the backoff has grown before space comes back
        wait_for(lambda: sum(e.get("event") == "store_retry" for e in sc.events()) >= 8, 40, "repeated retries")
        filler.unlink()
        wait_for(lambda: store_tree(store).get("c.json") == (work / ".checkpoints" / "c.json").read_bytes(), 10,
                 "the backlog stored soon after space came back")
        assert sc.stop() == 0, sc.log()[-3000:]
    finally:
        subprocess.run(["umount", "-l", str(store)], capture_output=True)


def test_huge_stored_numbers_are_malformed_values_not_crashes(tmp_path):
    """A stored mtime of 10^30 and an owner marker naming generation 2^100 (a store edited by
    hand, or by something else): the restore and the claim go on, one line each at most."""
    import json as json_

    store = tmp_path / "store"
    src = tmp_path / "src"
    write_atomic(src / ".checkpoints" / "c.json", b"data")
    env = sidecar_env(SIDECAR_STORE=str(store))
    assert run_cli("run", "--", "true", cwd=src, env=env).returncode == 0
    record = store / ".sidecar-meta" / ".checkpoints" / "c.json.json"
    rec = json_.loads(record.read_bytes())
    record.write_text(json_.dumps({**rec, "mtime_ns": 10**30}))
    (store / ".sidecar" / "owner").write_text(json_.dumps({"generation": 2**100, "heartbeat": 10**30}))

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    r = run_cli("run", "--", "true", cwd=fresh, env=env)
    assert r.returncode == 0, r.stderr
    assert "unexpected" not in r.stderr and "Traceback" not in r.stderr
    assert disk_tree(fresh / ".checkpoints") == {"c.json": b"data"}
    assert any(e.get("event") == "fence_claimed" for e in json_lines(r.stderr)), r.stderr


def test_an_object_changed_behind_the_stores_back_is_caught_as_corrupt(tmp_path):
    """Its bytes rewritten by something else (the data file's mtime changes, the record stays):
    the restore checks them against the recorded sha256 and fails, naming the object."""
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"))
    src = tmp_path / "src"
    write_atomic(src / ".checkpoints" / "c.json", b'{"good": true}')
    assert run_cli("run", "--", "true", cwd=src, env=env).returncode == 0
    (tmp_path / "store" / ".checkpoints" / "c.json").write_bytes(b'{"goo')  # truncated by hand
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    r = run_cli("restore", cwd=fresh, env=env)
    assert r.returncode == 1 and ".checkpoints/c.json" in r.stderr and "sha256" in r.stderr, r.stderr[-2000:]
    assert not (fresh / ".checkpoints" / "c.json").exists()
