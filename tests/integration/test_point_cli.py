"""``checkpoint-sidecar restore --as-of`` and ``history`` as real processes on a directory store the
real ``run`` mirrored, with the restore points its point writer wrote."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import anyio

from sidecar.store.directory import DirectoryStore
from support import disk_tree, json_lines, run_cli, sidecar_env, write_atomic
from tests.pointkit import after


def mirror(work: Path, store: Path, files: dict[str, bytes], gone: tuple[str, ...] = (), **env: str) -> None:
    """The host writes ``files`` and removes ``gone`` under the real ``run``, which mirrors them
    (and, at its drain, writes a restore point)."""
    for rel, data in files.items():
        write_atomic(work / rel, data)
    for rel in gone:
        (work / rel).unlink()
    r = run_cli("run", "--store", str(store), "--", "true", cwd=work, env=sidecar_env(**env))
    assert r.returncode == 0, r.stderr


def history(store: Path, cwd: Path) -> list[dict]:
    r = run_cli("history", "--json", "--store", str(store), cwd=cwd)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def wait_past(store: Path, t: str) -> None:
    """Until the store's clock is past the time ``t`` (as history prints it)."""
    async def go() -> None:
        s = DirectoryStore(str(store))
        await s.open()
        await after(s, datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp())

    anyio.run(go)


def files_of(store: Path) -> dict[str, tuple[int, bytes]]:
    out = {}
    for p in sorted(store.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(store))] = (p.stat().st_mtime_ns, p.read_bytes())
    return out


def test_restore_as_of_and_history(tmp_path):
    work, store = tmp_path / "work", tmp_path / "store"
    work.mkdir()
    first = {".checkpoints/r1/a.json": b'{"turn": 1}', ".checkpoints/r1/b.json": os.urandom(3000)}
    mirror(work, store, first)  # its drain writes a full point
    [full] = history(store, work)
    wait_past(store, full["time"])
    mirror(work, store, {".checkpoints/r1/a.json": b"garbage"}, gone=(".checkpoints/r1/b.json",))  # the damage

    r = run_cli("history", "--store", str(store), cwd=work)
    assert r.returncode == 0, r.stderr
    rows = history(store, work)
    assert [(x["kind"], x["files"], x.get("deleted")) for x in rows] == [("incr", 1, 1), ("full", 2, None)]
    assert rows[1] == full and rows[0]["seq"] > full["seq"] and rows[0]["base"] == full["seq"]
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and lines[0].endswith(f"seq {rows[0]['seq']}  (1 deleted)")
    assert lines[1].startswith(full["time"]) and " full " in lines[1] and " 2 files " in lines[1]
    assert rows[0]["time"].endswith("Z") and rows[0]["bytes"] == (store / rows[0]["key"]).stat().st_size

    latest = tmp_path / "latest"  # the latest state, from the writer's chain (full + incr)
    latest.mkdir()
    r = run_cli("restore", "--store", str(store), cwd=latest)
    assert r.returncode == 0, r.stderr
    done = next(e for e in json_lines(r.stderr) if e["event"] == "restore_done")
    assert done["files"] == done["from_points"] == 1
    assert disk_tree(latest / ".checkpoints") == {"r1/a.json": b"garbage"}

    before = files_of(store)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    r = run_cli("restore", "--store", str(store), "--as-of", full["time"], cwd=fresh)  # as history shows it
    assert r.returncode == 0, r.stderr
    assert disk_tree(fresh / ".checkpoints") == {k.removeprefix(".checkpoints/"): v for k, v in first.items()}
    assert files_of(store) == before, "restore --as-of wrote to the store"
    by_seq = tmp_path / "by-seq"  # the same point, named by the seq history lists
    by_seq.mkdir()
    r = run_cli("restore", "--store", str(store), "--as-of", f"seq:{full['seq']}", cwd=by_seq)
    assert r.returncode == 0, r.stderr
    assert disk_tree(by_seq / ".checkpoints") == disk_tree(fresh / ".checkpoints")
    assert f"(seq {full['seq']})" in r.stdout

    # the roots hold files now: refused, unless forced
    r = run_cli("restore", "--store", str(store), "--as-of", rows[0]["time"], cwd=fresh)
    assert r.returncode == 1 and "hold files" in r.stderr and "--force-restore" in r.stderr
    # forced: each root made equal to the point (b.json deleted in it, a.json other bytes); what it
    # lacks and what it holds otherwise moved beside the root, never overwritten
    r = run_cli("restore", "--store", str(store), "--as-of", "0s", "--force-restore", cwd=fresh)
    assert r.returncode == 0, r.stderr
    assert disk_tree(fresh / ".checkpoints") == {"r1/a.json": b"garbage"}
    [into] = fresh.glob(".checkpoints.replaced-*")
    assert disk_tree(into) == {k.removeprefix(".checkpoints/"): v for k, v in first.items()}
    assert (f"moved 2 entries that differ from the point out of {fresh / '.checkpoints'} into {into}: "
            f"\"r1/a.json\", \"r1/b.json\"\n") in r.stdout

    empty = tmp_path / "empty"
    empty.mkdir()
    early = (datetime.datetime.fromisoformat(full["time"].replace("Z", "+00:00")) - datetime.timedelta(hours=1))
    r = run_cli("restore", "--store", str(store), "--as-of", early.isoformat(), cwd=empty)
    assert r.returncode == 1
    [line] = [x for x in r.stderr.splitlines() if "restore --as-of failed" in x]
    assert "no restore point at or before" in line and f"the oldest is at {full['time']}" in line
    assert not (empty / ".checkpoints").exists()

    r = run_cli("restore", "--store", str(store), "--as-of", "yesterday", cwd=empty)
    assert r.returncode == 2 and "usage error" in r.stderr


def test_history_of_a_namespace_without_points(tmp_path):
    work, store = tmp_path / "work", tmp_path / "store"
    work.mkdir()
    mirror(work, store, {".checkpoints/x.json": b"x"}, SIDECAR_RESTORE_POINT_INTERVAL="0")
    r = run_cli("history", "--store", str(store), cwd=work)
    assert r.returncode == 0 and "no restore points" in r.stdout
    r = run_cli("history", "--json", "--store", str(store), cwd=work)
    assert r.returncode == 0 and r.stdout == ""


def test_history_into_a_closed_pipe_is_one_line(tmp_path):
    """``history | head -1`` once head has gone: one line and exit 1 (it was "unexpected
    BrokenPipeError"), as ``sessions`` and ``verify`` say it."""
    import subprocess

    from support import sidecar_cmd

    work, store = tmp_path / "work", tmp_path / "store"
    mirror(work, store, {".checkpoints/ctx/a.json": b"a"})
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first line
    try:
        p = subprocess.run(sidecar_cmd("history", "--store", str(store)), cwd=work, env=sidecar_env(), stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert p.returncode == 1, p.stderr
    assert "cannot write the list: Broken pipe" in p.stderr and "unexpected" not in p.stderr, p.stderr


def test_an_exact_restore_into_a_live_sessions_roots_is_refused(tmp_path):
    """``restore --as-of --force-restore`` while the session's sidecar runs moved the host's
    newest checkpoint from under it, and the live sidecar deleted it from the store (an outside
    tester's finding). Refused (exit 2, a complete command to go on) while the marker is live;
    once the sidecar stopped (a clean stop releases it), it runs."""
    from support import Sidecar

    work, store = tmp_path / "work", tmp_path / "store"
    mirror(work, store, {".checkpoints/ctx/old.json": b"old"})
    write_atomic(work / ".checkpoints" / "ctx" / "paused-workflow.json", b"the host's newest")
    sc = Sidecar(work, "sync", "--store", str(store), env=sidecar_env(SIDECAR_HTTP_ADDR=""))
    try:
        sc.wait_event("fence_claimed")
        before = disk_tree(work / ".checkpoints")
        r = run_cli("restore", "--store", str(store), "--as-of", "0s", "--force-restore", cwd=work)
        assert r.returncode == 2, r.stderr
        assert "the namespace is live" in r.stderr and "checkpoint-sidecar release --force" in r.stderr, r.stderr
        assert disk_tree(work / ".checkpoints") == before and not list(work.glob(".checkpoints.replaced-*"))
        assert sc.proc.poll() is None, "the live sidecar was harmed"
    finally:
        assert sc.stop() == 0, sc.log()[-3000:]
    r = run_cli("restore", "--store", str(store), "--as-of", "0s", "--force-restore", cwd=work)
    assert r.returncode == 0, r.stderr
