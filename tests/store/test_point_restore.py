"""Restoring from restore points, on both stores (the directory store and Azure Blob on Azurite):
the fast restore of the latest state, ``restore --as-of``, and points that must never be used.
Points are written with the writer's own encoder (``sidecar.points``) from the stored objects."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from sidecar.paths import Root
from sidecar.restore.asof import AsOfError, aside_line, restore_as_of
from sidecar.restore.latest import restore
from sidecar.restorefs import Lineage, read_lineage
from sidecar.store.base import ObjectMeta, Stream
from tests.pointkit import Counting, after, objects, point_blob, put_blob, write_point

pytestmark = pytest.mark.anyio

ROOT = ".checkpoints"


def tree(path: Path) -> dict[str, bytes]:
    """Every regular file below ``path`` (the sidecar's own records left out), by key."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and not p.name.startswith(".sidecar"):
            out[f"{ROOT}/{p.relative_to(path)}"] = p.read_bytes()
    return out


async def stored(store) -> dict[str, bytes]:
    return {k: (await store.get(k))[0] for k in await objects(store)}


async def put(store, key: str, data: bytes, version: int) -> None:
    await store.put(key, data, ObjectMeta.of(data, 1_700_000_000_000_000_000 + version, 0o640, version))


async def seed(store, n: int = 20) -> None:
    for i in range(n):
        await put(store, f"{ROOT}/d{i % 3}/{i}.json", os.urandom(100 + i), i + 1)


def root_in(tmp_path: Path, name: str = "w") -> Root:
    return Root(ROOT, str(tmp_path / name / ROOT))


def warnings(caplog, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == event]


async def test_fast_restore_takes_matching_files_from_the_chain_and_gets_only_the_rest(make_store, tmp_path):
    store = await make_store()
    await seed(store)
    await write_point(store, 100)  # full: the 20 files
    await put(store, f"{ROOT}/d2/2.json", b"rewritten in the increment", 120)
    await store.delete(f"{ROOT}/d0/3.json")
    await write_point(store, 150, [f"{ROOT}/d2/2.json"], base=100, prev=100, deleted=[f"{ROOT}/d0/3.json"])
    # after the newest point: a rewrite, a delete and a new file
    await put(store, f"{ROOT}/d0/0.json", b"rewritten after the point", 200)
    await store.delete(f"{ROOT}/d1/1.json")
    await put(store, f"{ROOT}/new.json", b"new after the point", 201)
    latest = await stored(store)

    counting = Counting(store)
    root = root_in(tmp_path)
    _, result = await restore(counting, [root])
    assert tree(Path(root.path)) == latest  # never the deleted d1/1.json, nor d0/3.json
    assert result.files == len(latest) == 19 and result.from_points == 17
    assert counting.gets(ROOT) == [f"{ROOT}/d0/0.json", f"{ROOT}/new.json"]  # only what changed after the point
    assert counting.gets(".sidecar/points/") == [
        ".sidecar/points/0000000000000000100-full.tar",
        ".sidecar/points/0000000000000000150-incr-0000000000000000100.tar"]  # each read once
    assert [k for op, k in counting.calls if op == "list"] == ["", ".sidecar/points/"] or \
        sorted(k for op, k in counting.calls if op == "list") == ["", ".sidecar/points/"]
    st = os.stat(Path(root.path) / "d2/5.json")
    assert (st.st_mtime_ns, st.st_mode & 0o777) == (1_700_000_000_000_000_006, 0o640)  # the listed metadata


async def test_a_corrupt_point_falls_back_to_the_objects_with_one_warning(make_store, tmp_path, caplog):
    store = await make_store()
    await seed(store)
    latest = await stored(store)
    key, blob = await point_blob(store, 100, list(latest))
    await put_blob(store, key, os.urandom(len(blob)))  # garbage
    root = root_in(tmp_path, "garbage")
    _, result = await restore(store, [root])
    assert tree(Path(root.path)) == latest and result.from_points == 0
    assert len(warnings(caplog, "restore_point_unusable")) == 1

    caplog.clear()
    header_end = blob.index(b"\x00", blob.index(b'"entries"'))
    member = blob.index(latest[f"{ROOT}/d0/9.json"][:32], header_end)
    bad = blob[:member] + bytes(b ^ 0xFF for b in blob[member:member + 10]) + blob[member + 10:]  # wrong sha
    await put_blob(store, key, bad)
    root = root_in(tmp_path, "wrong-sha")
    _, result = await restore(store, [root])
    assert tree(Path(root.path)) == latest
    assert 0 < result.from_points < len(latest)  # the entries before the bad one, each verified
    assert len(warnings(caplog, "restore_point_unusable")) == 1


async def test_a_point_cut_short_is_never_used(make_store, tmp_path, caplog):
    store = await make_store()
    await seed(store)
    latest = await stored(store)
    key, blob = await point_blob(store, 100, list(latest))
    for cut in (len(blob) // 2, len(blob) - 1024 - 1):  # in a member, and in the end-of-archive blocks
        caplog.clear()
        await put_blob(store, key, blob[:cut])
        counting = Counting(store)
        root = root_in(tmp_path, f"cut{cut}")
        _, result = await restore(counting, [root])
        assert tree(Path(root.path)) == latest and result.from_points == 0
        assert len(counting.gets(ROOT)) == len(latest)
        assert len(warnings(caplog, "restore_point_unusable")) == 1


async def test_no_point_restores_as_before(make_store, tmp_path, caplog):
    store = await make_store()
    await seed(store, 5)
    root = root_in(tmp_path)
    _, result = await restore(store, [root])
    assert tree(Path(root.path)) == await stored(store) and result.from_points == 0
    assert not warnings(caplog, "restore_point_unusable")


async def test_as_of_gives_exactly_the_tree_of_that_time(make_store, tmp_path):
    store = await make_store()
    await seed(store, 6)
    at_full = await stored(store)
    full = await write_point(store, 100)
    await after(store, full.modified)
    await put(store, f"{ROOT}/d1/1.json", b"rewritten", 110)
    await store.delete(f"{ROOT}/d2/2.json")
    await put(store, f"{ROOT}/added.json", b"added", 111)
    at_incr = await stored(store)
    incr = await write_point(store, 120, [f"{ROOT}/d1/1.json", f"{ROOT}/added.json"], base=100, prev=100,
                             deleted=[f"{ROOT}/d2/2.json"])
    await after(store, incr.modified)
    # later rewrites and deletes, and a point of them: not in either tree
    await put(store, f"{ROOT}/d0/0.json", b"damaged", 130)
    await store.delete(f"{ROOT}/added.json")
    await write_point(store, 140, [f"{ROOT}/d0/0.json"], base=100, prev=120, deleted=[f"{ROOT}/added.json"])
    lineage = Lineage(store.description, "", 0)

    for when, expected in ((full.modified, at_full), (incr.modified, at_incr)):
        root = root_in(tmp_path, f"asof{when}")
        done = await restore_as_of(store, [root], when, None, force=False, lineage=lineage)
        assert tree(Path(root.path)) == expected
        assert done.files == len(expected)
        assert read_lineage(root) == lineage  # this namespace's disk from now on
        assert not (Path(root.path) / ".sidecar-restoring").exists()

    with pytest.raises(AsOfError, match=r"no restore point at or before .*\(the oldest is at "):
        await restore_as_of(store, [root_in(tmp_path, "early")], full.modified - 3600, None, force=False,
                            lineage=lineage)
    held = root_in(tmp_path, "held")
    Path(held.path).mkdir(parents=True)
    (Path(held.path) / "mine.json").write_bytes(b"local")
    with pytest.raises(AsOfError, match="hold files"):
        await restore_as_of(store, [held], incr.modified, None, force=False, lineage=lineage)
    done = await restore_as_of(store, [held], incr.modified, None, force=True, lineage=lineage)
    assert tree(Path(held.path)) == at_incr  # exactly: mine.json moved beside the root
    assert [(a.paths, (Path(a.into) / "mine.json").read_bytes()) for a in done.aside] == [(["mine.json"], b"local")]
    # a duration ago, on the store's clock: 0s is now, the newest point
    root = root_in(tmp_path, "now")
    await restore_as_of(store, [root], None, 0.0, force=False, lineage=lineage)
    assert hashlib.sha256(tree(Path(root.path))[f"{ROOT}/d0/0.json"]).digest() == hashlib.sha256(b"damaged").digest()


async def test_as_of_seq_chooses_a_point_whatever_its_time(make_store, tmp_path):
    """``--as-of seq:N``: the newest point at or before seq N, whatever the points' times (on
    Azure two points in one second of Last-Modified share their time: only the seq tells them
    apart)."""
    store = await make_store()
    await seed(store, 3)
    at_full = await stored(store)
    full = await write_point(store, 100)
    await put(store, f"{ROOT}/d0/0.json", b"rewritten", 110)
    at_incr = await stored(store)
    await write_point(store, 120, [f"{ROOT}/d0/0.json"], base=100, prev=100)
    lineage = Lineage(store.description, "", 0)
    for seq, expected in ((100, at_full), (119, at_full), (120, at_incr), (10**18, at_incr)):
        root = root_in(tmp_path, f"seq{seq}")
        done = await restore_as_of(store, [root], None, None, seq=seq, force=False, lineage=lineage)
        assert tree(Path(root.path)) == expected
        assert done.point.seq == (100 if expected is at_full else 120)
        assert done.time == full.modified or done.point.seq == 120
    with pytest.raises(AsOfError, match=r"no restore point at or before seq 99 .*\(the oldest is seq 100\)"):
        await restore_as_of(store, [root_in(tmp_path, "early")], None, None, seq=99, force=False, lineage=lineage)


async def test_as_of_never_uses_a_point_cut_short(make_store, tmp_path, caplog):
    store = await make_store()
    await seed(store, 4)
    at_full = await stored(store)
    full = await write_point(store, 100)
    await after(store, full.modified)
    await put(store, f"{ROOT}/d0/0.json", b"rewritten", 110)
    key, blob = await point_blob(store, 120, [f"{ROOT}/d0/0.json"], base=100, prev=100)
    incr = await put_blob(store, key, blob[: len(blob) // 2])
    root = root_in(tmp_path)
    await restore_as_of(store, [root], incr.modified, None, force=False, lineage=Lineage(store.description, ""))
    assert tree(Path(root.path)) == at_full  # the newest usable point at or before the time
    assert len(warnings(caplog, "restore_point_unusable")) == 1


async def test_a_long_chain_reads_only_the_increments_that_hold_listed_files(make_store, tmp_path):
    store = await make_store()
    await seed(store, 5)
    await write_point(store, 100)
    early, churn = f"{ROOT}/d1/1.json", f"{ROOT}/churn.json"
    for n in range(10):  # ten increments: the first rewrites ``early``; the 2nd, 3rd and last ``churn``
        key = early if n == 0 else churn if n in (1, 2, 9) else f"{ROOT}/later/{n}.json"
        await put(store, key, f"increment {n}".encode(), 1000 + 10 * n)
        await write_point(store, 1005 + 10 * n, [key], base=100, prev=100 if n == 0 else 995 + 10 * n)
    await store.delete(f"{ROOT}/later/5.json")  # deleted after its point: gone for good
    latest = await stored(store)
    counting = Counting(store)
    root = root_in(tmp_path)
    _, result = await restore(counting, [root])
    assert tree(Path(root.path)) == latest
    assert result.from_points == len(latest) and counting.gets(ROOT) == []
    read = [int(k.rsplit("/", 1)[1].split("-", 1)[0]) for k in counting.gets(".sidecar/points/")]
    # the full, the 7 newest increments, and the first (the only older one that holds a listed file)
    assert read == [100, 1005, *range(1035, 1100, 10)]


async def test_a_rotten_object_that_a_point_holds_is_restored_from_the_point(make_store, tmp_path):
    """An object whose stored bytes no longer hash to its recorded sha256, at the version a point
    holds, is never fetched: its file comes from the point, verified."""
    store = await make_store()
    await seed(store, 6)
    latest = await stored(store)
    await write_point(store, 100)
    key = f"{ROOT}/d1/4.json"
    info = (await objects(store))[key]
    rotten = bytes(b ^ 0xFF for b in latest[key])
    await store.put(key, rotten, ObjectMeta(len(rotten), info.sha256, info.mtime_ns, info.mode, info.version))
    assert (await store.get(key))[0] == rotten  # the store holds the rot under the old digest

    counting = Counting(store)
    root = root_in(tmp_path)
    _, result = await restore(counting, [root])
    assert tree(Path(root.path)) == latest and result.from_points == len(latest)
    assert counting.gets(ROOT) == []


class _ChangesMidRead:
    """The point ``key`` changes while it is read: its second read (the first is the header check)
    fails after its first chunk, as Azure's ranged GET pinned to the first answer's ETag does."""

    def __init__(self, store, key: str) -> None:
        self.store, self.key, self.reads = store, key, 0

    async def get_stream(self, key: str, read_ahead: int = 0):
        from sidecar.store.base import TransientStoreError

        info, chunks = await self.store.get_stream(key, read_ahead)
        if key != self.key:
            return Stream(info, chunks)
        self.reads += 1
        if self.reads != 2:
            return Stream(info, chunks)

        async def broken():
            try:
                async for chunk in chunks:
                    yield chunk
                    raise TransientStoreError(f"downloading {key!r} failed: the blob changed while it was read "
                                              "(412 ConditionNotMet); will retry")
            finally:
                await chunks.aclose()

        return Stream(info, broken())

    def __getattr__(self, name: str):
        return getattr(self.store, name)


async def test_as_of_cut_off_by_the_store_says_how_to_finish_it(make_store, tmp_path):
    """A point that cannot be read to its end once files are placed (it changed meanwhile): one
    AsOfError that says the roots keep what was placed and to run it again with --force-restore
    (a plain rerun is refused: the roots hold files), never the daemon's "will retry"; that
    rerun gives exactly the tree."""
    store = await make_store()
    await put(store, f"{ROOT}/a.json", b"first", 1)
    await put(store, f"{ROOT}/b.bin", os.urandom(5 * 1024 * 1024), 2)  # past the point's first chunk
    expected = await stored(store)
    full = await write_point(store, 100)
    [key] = [i.key async for i in store.list(".sidecar/points/")]
    root = root_in(tmp_path)
    lineage = Lineage(store.description, "", 0)
    with pytest.raises(AsOfError) as failed:
        await restore_as_of(_ChangesMidRead(store, key), [root], full.modified, None, force=False, lineage=lineage)
    said = str(failed.value)
    assert "--force-restore" in said and "will retry" not in said and "changed while it was read" in said, said
    assert (Path(root.path) / ".sidecar-restoring").exists()
    with pytest.raises(AsOfError, match="hold files"):
        await restore_as_of(store, [root], full.modified, None, force=False, lineage=lineage)
    await restore_as_of(store, [root], full.modified, None, force=True, lineage=lineage)
    assert tree(Path(root.path)) == expected
    assert not (Path(root.path) / ".sidecar-restoring").exists()


def exact_case(tmp_path: Path) -> tuple[Root, Path]:
    """A root holding what a point of :func:`seed` (6 files) lacks, one of its files with other
    bytes (``d0/0.json``: moved aside too, never overwritten), and a directory outside it."""
    root = root_in(tmp_path, "exact")
    r, outside = Path(root.path), tmp_path / "outside"
    outside.mkdir()
    (outside / "theirs.json").write_bytes(b"not the sidecar's")
    for rel, data in {"d0/0.json": b"an older copy", "stale.json": b"stale", "old/deep/x.json": b"x",
                      "d1/extra.json": b"extra", "new\nline.json": b"a name to escape",
                      "d2/5.json/inner.json": b"where the point has a file", "d2/5.json/x.tmp": b"ignored",
                      "writer.tmp": b"ignored: not the sidecar's", ".sidecar-lineage": b"{}"}.items():
        (r / rel).parent.mkdir(parents=True, exist_ok=True)
        (r / rel).write_bytes(data)
    (r / "empty").mkdir()
    (r / "link").symlink_to(outside)  # a symlink is moved as itself, never followed
    (r / "d0/3.json").symlink_to(outside / "theirs.json")  # where the point has a file
    return root, outside


MOVED = ["d0/0.json", "d0/3.json", "d1/extra.json", "d2/5.json/", "empty/", "link", "new\nline.json", "old/",
         "old/deep/", "old/deep/x.json", "stale.json"]
#: What the directories beside the root hold besides MOVED's files: a directory where the point has
#: a file is moved whole, an ignored file in it included (it was left, and the point's file refused).
INSIDE = ["d2/5.json/inner.json", "d2/5.json/x.tmp"]


def moved_tree(into: list[Path]) -> dict[str, str]:
    """What the directories beside a root hold, by relative path: a file's bytes, a link's target."""
    out = {}
    for d in into:
        for p in d.rglob("*"):
            rel = str(p.relative_to(d)) + ("/" if p.is_dir() and not p.is_symlink() else "")
            out[rel] = os.readlink(p) if p.is_symlink() else p.read_bytes().decode() if p.is_file() else ""
    return out


async def test_as_of_forced_makes_each_root_equal_the_point(make_store, tmp_path):
    """``restore --as-of --force-restore`` into a root that holds files makes it equal the point's
    tree: the point's files written over the root's, and everything the point lacks (files,
    symlinks, directories left empty) moved into one directory beside the root, their paths kept,
    never followed out of the root; ignored names and the sidecar's records stay."""
    store = await make_store()
    await seed(store, 6)
    expected = await stored(store)
    full = await write_point(store, 100)
    root, outside = exact_case(tmp_path)
    lineage = Lineage(store.description, "", 0)
    done = await restore_as_of(store, [root], full.modified, None, force=True, lineage=lineage)

    r = Path(root.path)
    assert tree(r) == {**expected, f"{ROOT}/writer.tmp": b"ignored: not the sidecar's"}
    assert sorted(str(p.relative_to(r)) for p in r.rglob("*") if p.is_dir()) == ["d0", "d1", "d2"]
    [into] = list(r.parent.glob(".checkpoints.replaced-*"))
    [aside] = done.aside
    assert (Path(aside.into), aside.root, sorted(aside.paths), aside.moved) == (into, root, MOVED, len(MOVED))
    assert moved_tree([into]) == {
        "d0/": "", "d0/0.json": "an older copy", "d0/3.json": str(outside / "theirs.json"), "d1/": "",
        "d1/extra.json": "extra", "d2/": "",
        "d2/5.json/": "", "d2/5.json/inner.json": "where the point has a file", "d2/5.json/x.tmp": "ignored",
        "empty/": "", "link": str(outside),
        "new\nline.json": "a name to escape", "old/": "", "old/deep/": "", "old/deep/x.json": "x", "stale.json": "stale"}
    assert [p.name for p in outside.iterdir()] == ["theirs.json"]
    assert (outside / "theirs.json").read_bytes() == b"not the sidecar's"
    assert read_lineage(root) == lineage and not (r / ".sidecar-restoring").exists()
    assert done.files == len(expected)
    assert aside_line(aside, 7) == (f'moved 11 entries that differ from the point out of {r} into {into}: "d0/0.json", '
                                    '"d0/3.json", "d1/extra.json", "d2/5.json/", "empty/", "link", "new\\nline.json" and 4 '
                                    'more')

    # into a root the point already equals: nothing to move, no directory made
    done = await restore_as_of(store, [root], full.modified, None, force=True, lineage=lineage)
    assert done.aside == [] and list(r.parent.glob(".checkpoints.replaced-*")) == [into]


async def test_as_of_forced_moves_aside_or_changes_nothing_and_a_rerun_finishes(make_store, tmp_path, monkeypatch):
    """A root whose entries cannot be renamed beside it (a mount point), or a move that fails
    first, changes nothing: one AsOfError, the root as it was, no marker and no directory beside
    it. One that fails part way leaves the restore marker and says to run it again with
    --force-restore, which finishes: the root equals the point, what it lacked is in the
    directories beside it, nothing deleted."""
    from sidecar import restorefs

    store = await make_store()
    await seed(store, 6)
    expected = await stored(store)
    full = await write_point(store, 100)
    root, outside = exact_case(tmp_path)
    r = Path(root.path)
    lineage = Lineage(store.description, "", 0)
    real_move, calls = restorefs._move, []

    def fails_at(n: int):
        def move(name: str, sfd: int, dfd: int) -> None:
            calls.append(name)
            if len(calls) >= n:
                raise OSError(18, "Invalid cross-device link")
            real_move(name, sfd, dfd)
        return move

    before = sorted((str(p.relative_to(r)), p.is_symlink()) for p in r.rglob("*"))
    with monkeypatch.context() as m:  # the root a mount point: its parent on another filesystem
        m.setattr(restorefs, "aside_parent", lambda root: "/proc")
        with pytest.raises(AsOfError, match=r"on another filesystem than /proc .*\(nothing was changed\)$"):
            await restore_as_of(store, [root], full.modified, None, force=True, lineage=lineage)
    assert sorted((str(p.relative_to(r)), p.is_symlink()) for p in r.rglob("*")) == before
    assert not (r / ".sidecar-restoring").exists()

    monkeypatch.setattr(restorefs, "_move", fails_at(1))
    with pytest.raises(AsOfError, match=r"Invalid cross-device link \(nothing was changed\)$"):
        await restore_as_of(store, [root], full.modified, None, force=True, lineage=lineage)
    assert sorted((str(p.relative_to(r)), p.is_symlink()) for p in r.rglob("*")) == before
    assert list(r.parent.glob(".checkpoints.replaced-*")) == [] and not (r / ".sidecar-restoring").exists()

    calls.clear()
    monkeypatch.setattr(restorefs, "_move", fails_at(4))
    with pytest.raises(AsOfError) as failed:
        await restore_as_of(store, [root], full.modified, None, force=True, lineage=lineage)
    assert "(3 entries were moved there)" in str(failed.value) and "--force-restore" in str(failed.value)
    assert (r / ".sidecar-restoring").exists()

    monkeypatch.setattr(restorefs, "_move", real_move)
    await restore_as_of(store, [root], full.modified, None, force=True, lineage=lineage)
    assert tree(r) == {**expected, f"{ROOT}/writer.tmp": b"ignored: not the sidecar's"}
    into = list(r.parent.glob(".checkpoints.replaced-*"))
    assert len(into) == 2 and {k for k in moved_tree(into) if not k.endswith("/")} == {
        m for m in MOVED if not m.endswith("/")} | set(INSIDE)
    assert read_lineage(root) == lineage and not (r / ".sidecar-restoring").exists()


class HeldListing:
    """A store whose namespace listing (prefix "") gives every object, then waits for ``release``
    before it ends, as a long listing's last page would."""

    def __init__(self, store) -> None:
        self.store = store
        self.release = __import__("anyio").Event()

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    async def list(self, prefix: str = ""):
        async for info in self.store.list(prefix):
            yield info
        if not prefix:
            await self.release.wait()


async def test_a_points_files_are_placed_while_the_store_is_still_listed(make_store, tmp_path):
    """The point is read while the namespace is listed: each file it holds is placed as soon as
    the listing has offered it, not once the listing has ended; a file deleted after the point,
    never offered, is still never restored."""
    import anyio

    store = await make_store()
    await seed(store, 6)
    await write_point(store, 100)
    await store.delete(f"{ROOT}/d2/5.json")  # after the point (its member the point's last: none waits behind it)
    # after the point, and last by name: a store listing in name order releases each key once a
    # name past its path has come (ShapeConflicts), so this one, held, lets every other go
    await put(store, f"{ROOT}/zz.json", b"written after the point", 300)
    latest = await stored(store)
    from_point = {k: v for k, v in latest.items() if not k.endswith("zz.json")}
    held = HeldListing(store)
    root = root_in(tmp_path)
    done: list = []

    async def run() -> None:
        done.append(await restore(held, [root]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        with anyio.fail_after(60):  # a poll with a deadline: the point's files placed, the listing still open
            while from_point.items() - tree(Path(root.path)).items():
                await anyio.sleep(0.02)
        assert not done  # the listing has not ended
        held.release.set()
    _, result = done[0]
    assert tree(Path(root.path)) == latest and result.from_points == len(from_point) == 5


async def test_as_of_with_a_file_it_could_not_place_fails_and_records_nothing(make_store, tmp_path):
    """A directory stands where the point has a file, holding only an ignored name (so the root
    counts as empty): the file is refused. The restore used to exit 0 and write the lineage
    record, and the next sidecar took the disk for the truth and deleted the file from the store.
    Now: AsOfError, the restore marker kept, no record; forced, the directory is moved whole."""
    store = await make_store()
    await seed(store, 6)
    expected = await stored(store)
    full = await write_point(store, 100)
    root = root_in(tmp_path)
    blocker = Path(root.path) / "d2" / "5.json"
    blocker.mkdir(parents=True)
    (blocker / "x.tmp").write_bytes(b"ignored")
    lineage = Lineage(store.description, "", 0)
    with pytest.raises(AsOfError) as failed:
        await restore_as_of(store, [root], full.modified, None, force=False, lineage=lineage)
    assert "1 file of the point could not be placed" in str(failed.value) and "--force-restore" in str(failed.value)
    assert read_lineage(root) is None and (Path(root.path) / ".sidecar-restoring").exists()
    await restore_as_of(store, [root], full.modified, None, force=True, lineage=lineage)
    assert tree(Path(root.path)) == expected and read_lineage(root) == lineage


@pytest.mark.parametrize("why", ["a bind-mounted file", "a directory it may not write"])
async def test_as_of_forced_refuses_what_a_rename_would_fail_on_before_moving_anything(make_store, tmp_path,
                                                                                      monkeypatch, why):
    """A bind mount of a file shares its filesystem's device (only the mount table tells), and a
    directory this process may not write stops the moves part way: both were found only by a
    failing rename after other entries had moved. Now refused before anything changes."""
    from sidecar import restorefs

    store = await make_store()
    await seed(store, 6)
    full = await write_point(store, 100)
    root = root_in(tmp_path)
    r = Path(root.path)
    for rel in ("a/stale.json", "b/mounted.json"):
        (r / rel).parent.mkdir(parents=True, exist_ok=True)
        (r / rel).write_bytes(b"not in the point")
    if why == "a bind-mounted file":
        monkeypatch.setattr(restorefs, "_mount_points", lambda: ["/proc", os.path.realpath(r / "b/mounted.json")])
    else:
        access = os.access
        monkeypatch.setattr(restorefs.os, "access", lambda p, m: access(p, m) and not str(p).endswith("/b"))
    before = tree(r)
    with pytest.raises(AsOfError) as failed:
        await restore_as_of(store, [root], full.modified, None, force=True, lineage=Lineage(store.description, "", 0))
    assert "nothing was changed" in str(failed.value)
    assert tree(r) == before and not list(r.parent.glob(".checkpoints.replaced-*"))
    assert not (r / ".sidecar-restoring").exists()
