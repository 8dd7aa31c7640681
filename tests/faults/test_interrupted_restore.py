"""A restore cut short: SIGKILL, an OOM kill or an eviction while the root fills, then the
container restarts on the same volume (an ``emptyDir`` outlives its containers).

The half-filled root must never pass for the truth: ``auto`` leaves a root that holds files alone
and then makes the store match it, which would delete every stored file the cut-short restore had
not brought back yet. Checked: the next start restores the root again, and nothing stored is lost.
"""

from __future__ import annotations

import os
import signal

import pytest

from support import Sidecar, disk_tree, run_cli, seed_directory_store, store_tree, wait_for

pytestmark = [pytest.mark.faults]

FILES = 1500


def _count_files(root) -> int:
    n = 0
    for _dirpath, _dirs, files in os.walk(root):
        n += sum(1 for f in files if not f.startswith(".sidecar-"))
    return n


@pytest.fixture
def seeded(tmp_path):
    store = tmp_path / "store"
    files = {f".checkpoints/ctx{i % 20}/{i:04}.json": os.urandom(64 * 1024) for i in range(FILES)}  # 94 MiB
    seed_directory_store(store, files)
    return store, {k.removeprefix(".checkpoints/"): v for k, v in files.items()}


def _kill_mid_restore(work, store) -> int:
    """Start a restore and SIGKILL it once some files are in place; how many were (0 < n < all)."""
    cps = work / ".checkpoints"
    for _attempt in range(5):
        sc = Sidecar(work, "restore", "--store", str(store))
        wait_for(lambda sc=sc: sc.proc.poll() is not None or (cps.is_dir() and _count_files(cps) > 0), 60,
                 "the restore to place its first file", sc.log, interval=0.001)
        sc.kill()
        n = _count_files(cps)
        if 0 < n < FILES:
            return n
        for dirpath, _dirs, names in os.walk(cps, topdown=False):  # too early or too late: again
            for name in names:
                os.unlink(os.path.join(dirpath, name))
    pytest.fail("could not stop a restore half-way in 5 attempts")


def test_a_killed_restore_is_redone_and_nothing_stored_is_deleted(seeded, tmp_path):
    store, files = seeded
    work = tmp_path / "work"
    work.mkdir()
    placed = _kill_mid_restore(work, store)
    assert 0 < placed < FILES

    sc = Sidecar(work, "sync", "--store", str(store))
    sc.wait_event("ready", timeout=60)
    assert sc.stop() == 0, sc.log()
    decision = next(e for e in sc.events() if e.get("event") == "restore_decision" and e["root"].endswith(".checkpoints"))
    assert decision["restore"] is True and "cut short" in decision["reason"], decision
    assert store_tree(store) == files, "stored files were deleted after a cut-short restore"
    assert disk_tree(work / ".checkpoints") == files
    # no marker nor temp file left: only the record that this namespace filled the root
    assert [n for n in os.listdir(work / ".checkpoints") if n.startswith(".sidecar-")] == [".sidecar-lineage"]


def test_skip_mode_keeps_a_cut_short_root_from_deleting_stored_files(seeded, tmp_path):
    """``--no-restore`` trusts the disk, but a root a restore left half-filled is not the disk's
    truth: its stored files are kept (protected), with a warning saying why."""
    store, files = seeded
    work = tmp_path / "work"
    work.mkdir()
    _kill_mid_restore(work, store)

    sc = Sidecar(work, "sync", "--store", str(store), "--no-restore")
    sc.wait_event("ready", timeout=60)
    assert sc.stop(signal.SIGTERM) == 0, sc.log()
    assert any(e.get("event") == "restore_incomplete_root_protected" for e in sc.events()), sc.log()
    assert store_tree(store) == files

    r = run_cli("restore", "--store", str(store), cwd=work)  # auto: the root is redone, not trusted
    assert r.returncode == 0, r.stderr
    assert disk_tree(work / ".checkpoints") == files
