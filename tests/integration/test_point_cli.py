"""``checkpoint-sidecar restore --as-of`` and ``history`` as real processes on a directory store the
real ``run`` mirrored (points written with the writer's encoder from its objects)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio

from sidecar.store.directory import DirectoryStore
from support import disk_tree, run_cli, write_atomic
from tests.pointkit import after, write_point


def mirror(work: Path, store: Path, files: dict[str, bytes], gone: tuple[str, ...] = ()) -> None:
    """The host writes ``files`` and removes ``gone`` under the real ``run``, which mirrors them."""
    for rel, data in files.items():
        write_atomic(work / rel, data)
    for rel in gone:
        (work / rel).unlink()
    r = run_cli("run", "--store", str(store), "--", "true", cwd=work)
    assert r.returncode == 0, r.stderr


def point(store: Path, seq: int, **kw) -> float:
    """Write a point of the store's objects now; its time (store clock), once the clock moved on."""
    async def go() -> float:
        s = DirectoryStore(str(store))
        await s.open()
        info = await write_point(s, seq, **kw)
        await after(s, info.modified)
        return info.modified

    return anyio.run(go)


def files_of(store: Path) -> dict[str, tuple[int, bytes]]:
    out = {}
    for p in sorted(store.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(store))] = (p.stat().st_mtime_ns, p.read_bytes())
    return out


def iso(t: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat()


def test_restore_as_of_and_history(tmp_path):
    work, store = tmp_path / "work", tmp_path / "store"
    work.mkdir()
    first = {".checkpoints/r1/a.json": b'{"turn": 1}', ".checkpoints/r1/b.json": os.urandom(3000)}
    mirror(work, store, first)
    t1 = point(store, 2**41)  # above the first run's versions
    mirror(work, store, {".checkpoints/r1/a.json": b"garbage"}, gone=(".checkpoints/r1/b.json",))  # the damage
    t2 = point(store, 2**42)

    r = run_cli("history", "--store", str(store), cwd=work)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and lines[0].endswith(f"seq {2**42}") and lines[1].endswith(f"seq {2**41}")
    assert " full " in lines[1] and " 2 files " in lines[1]
    rows = [json.loads(line) for line in run_cli("history", "--json", "--store", str(store), cwd=work).stdout.splitlines()]
    assert [(x["kind"], x["files"], x["seq"]) for x in rows] == [("full", 1, 2**42), ("full", 2, 2**41)]
    assert rows[0]["time"].endswith("Z") and rows[0]["bytes"] == (store / rows[0]["key"]).stat().st_size

    before = files_of(store)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    r = run_cli("restore", "--store", str(store), "--as-of", rows[1]["time"], cwd=fresh)  # as history shows it
    assert r.returncode == 0, r.stderr
    assert disk_tree(fresh / ".checkpoints") == {k.removeprefix(".checkpoints/"): v for k, v in first.items()}
    assert files_of(store) == before, "restore --as-of wrote to the store"

    # the roots hold files now: refused, unless forced
    r = run_cli("restore", "--store", str(store), "--as-of", iso(t2), cwd=fresh)
    assert r.returncode == 1 and "hold files" in r.stderr and "--force-restore" in r.stderr
    r = run_cli("restore", "--store", str(store), "--as-of", "0s", "--force-restore", cwd=fresh)
    assert r.returncode == 0, r.stderr
    assert (fresh / ".checkpoints/r1/a.json").read_bytes() == b"garbage"

    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli("restore", "--store", str(store), "--as-of", iso(t1 - 3600), cwd=empty)
    assert r.returncode == 1
    [line] = [x for x in r.stderr.splitlines() if "restore --as-of failed" in x]
    assert "no restore point at or before" in line and "the oldest is at" in line
    assert not (empty / ".checkpoints").exists()

    r = run_cli("restore", "--store", str(store), "--as-of", "yesterday", cwd=empty)
    assert r.returncode == 2 and "usage error" in r.stderr


def test_history_of_a_namespace_without_points(tmp_path):
    work, store = tmp_path / "work", tmp_path / "store"
    work.mkdir()
    mirror(work, store, {".checkpoints/x.json": b"x"})
    r = run_cli("history", "--store", str(store), cwd=work)
    assert r.returncode == 0 and "no restore points" in r.stdout
    r = run_cli("history", "--json", "--store", str(store), cwd=work)
    assert r.returncode == 0 and r.stdout == ""
