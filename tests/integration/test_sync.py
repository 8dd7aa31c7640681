"""``sync`` as a real process against real files: bursts, deletes, renames, late roots, crashes."""

from __future__ import annotations

import os
import random

from support import Sidecar, disk_tree, remove_root, run_cli, store_tree, wait_for, write_atomic


def converged(work, store, name=".checkpoints"):
    return lambda: disk_tree(work / name) == store_tree(store, name)


def start(work, store, *extra) -> Sidecar:
    sc = Sidecar(work, "sync", "--store", str(store), *extra)
    sc.wait_event("ready")
    return sc


def test_burst_of_atomic_writes_is_mirrored_byte_exact(work):
    work, store = work
    sc = start(work, store)
    try:
        for i in range(300):
            write_atomic(work / ".checkpoints" / f"ctx{i % 7}" / f"{i:04}.json", os.urandom(random.randint(0, 5000)))
        wait_for(converged(work, store), 20, "store to match the disk")
        assert len(store_tree(store)) == 300
        assert not any(n.endswith(".tmp") for n in os.listdir(store / ".checkpoints" / "ctx0"))
    finally:
        assert sc.stop() == 0, sc.log()
    assert sc.has_event("shutdown_flushed")


def test_host_pattern_write_new_then_delete_old(work):
    work, store = work
    ctx = work / ".checkpoints" / "resp_1"
    sc = start(work, store)
    try:
        previous = None
        for turn in range(20):
            new = ctx / f"cp{turn}.json"
            write_atomic(new, f'{{"turn": {turn}}}'.encode())
            if previous is not None:
                previous.unlink()  # the host prunes all but the newest
            previous = new
        wait_for(converged(work, store), 10, "only the newest checkpoint in the store")
        assert list(store_tree(store)) == ["resp_1/cp19.json"]
    finally:
        sc.stop()


def test_renames_and_directory_moves(work):
    work, store = work
    cps = work / ".checkpoints"
    sc = start(work, store)
    try:
        write_atomic(cps / "a" / "1.json", b"one")
        write_atomic(cps / "a" / "2.json", b"two")
        wait_for(converged(work, store), 10, "initial files")
        os.rename(cps / "a" / "1.json", cps / "a" / "renamed.json")
        wait_for(converged(work, store), 10, "file rename")
        outside = work / "outside"
        outside.mkdir()
        write_atomic(outside / "d" / "x.json", b"moved in")
        os.rename(outside / "d", cps / "moved-in")  # a whole directory appears at once
        wait_for(converged(work, store), 10, "directory moved in")
        os.rename(cps / "a", outside / "a")  # and one leaves at once
        wait_for(converged(work, store), 10, "directory moved out")
        assert sorted(store_tree(store)) == ["moved-in/x.json"]
    finally:
        sc.stop()


def test_roots_created_late_and_recreated(work):
    work, store = work
    sc = start(work, store)  # neither root exists yet
    try:
        write_atomic(work / ".function_approvals" / "alice" / "approval_requests.json", b"[1]")
        write_atomic(work / ".checkpoints" / "c" / "1.json", b"x")
        wait_for(converged(work, store, ".function_approvals"), 10, "late approvals root")
        wait_for(converged(work, store), 10, "late checkpoints root")
        remove_root(work / ".checkpoints")  # gone as a whole: its stored files are kept
        sc.wait_event("root_gone")
        write_atomic(work / ".checkpoints" / "c" / "2.json", b"y")
        wait_for(lambda: store_tree(store) == {"c/1.json": b"x", "c/2.json": b"y"}, 10, "re-created root")
    finally:
        sc.stop()


def test_sigkill_and_restart_converges(work):
    work, store = work
    cps = work / ".checkpoints"
    sc = start(work, store)
    for i in range(200):
        write_atomic(cps / f"c{i % 5}" / f"{i}.json", os.urandom(100))
    sc.kill()  # mid-burst, whatever it had done
    # while the sidecar is down: some files go, some change, some appear
    for i in range(0, 200, 3):
        (cps / f"c{i % 5}" / f"{i}.json").unlink()
    for i in range(1, 200, 7):
        p = cps / f"c{i % 5}" / f"{i}.json"
        if p.exists():
            write_atomic(p, b"changed while down")
    write_atomic(cps / "new" / "n.json", b"new while down")
    sc2 = start(work, store)  # the root holds files: it is the truth
    try:
        wait_for(converged(work, store), 20, "store to converge after a crash")
    finally:
        assert sc2.stop() == 0


def test_symlinks_are_never_followed(work, tmp_path):
    work, store = work
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"outside the root")
    cps = work / ".checkpoints"
    cps.mkdir()
    (cps / "link.json").symlink_to(secret)
    (cps / "linkdir").symlink_to(tmp_path)
    sc = start(work, store)
    try:
        write_atomic(cps / "real.json", b"real")
        wait_for(lambda: store_tree(store) == {"real.json": b"real"}, 10, "only the real file")
    finally:
        sc.stop()


def test_status_reports_and_exits_by_sync_state(work):
    work, store = work
    write_atomic(work / ".checkpoints" / "c" / "1.json", b"x")
    store.mkdir()  # an empty store (one that is not there is an error, not "pending upload")
    r = run_cli("status", "--store", str(store), cwd=work)
    assert r.returncode == 1 and "1 pending upload" in r.stdout
    sc = start(work, store)
    wait_for(converged(work, store), 10, "mirrored")
    sc.stop()
    r = run_cli("status", "--store", str(store), "--json", cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    report = json.loads(r.stdout)
    assert report["in_sync"] and report["roots"][".checkpoints"]["in_sync"] == 1


def test_a_file_with_an_older_mtime_than_the_stored_one_is_stored(work):
    """Versions come from the sidecar, never from mtimes: a file copied with an old mtime kept
    (``cp -p``, ``tar x``, a clock stepped back) over a stored version stamped later is stored like
    any other change, with no touch needed."""
    from support import seed_directory_store

    work, store = work
    import time

    hour = 3600 * 10**9
    seed_directory_store(store, {".checkpoints/c/a.json": b"stored, stamped later"}, mtime_ns=time.time_ns() + hour)
    write_atomic(work / ".checkpoints" / "c" / "a.json", b"on disk, older mtime")
    os.utime(work / ".checkpoints" / "c" / "a.json", ns=(time.time_ns() - 2 * hour,) * 2)
    sc = start(work, store)
    try:
        wait_for(converged(work, store), 20, "the file stored")
        assert not sc.has_event("file_older_than_stored")
    finally:
        assert sc.stop() == 0, sc.log()
