"""A restore point never records as deleted a file the store keeps (found by an outside tester).

A root removed as a whole and made again by the host with a new file: the stored files it lacks
are kept (not deleted, see docs/MIRRORING.md). The points written after that must still hold them:
a point that recorded them as deleted gave ``restore --as-of`` a tree without them, and a sidecar
then taking that disk for the truth deleted them from the store. In process, on every store."""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import pytest

from sidecar.store.base import ObjectInfo
from support import write_atomic
from tests.inprocess import InProcess, run_sync, settings_for
from tests.pointkit import newest_tree

pytestmark = pytest.mark.anyio
#: whole sessions in process: the rules on the memory store in the fast suite, the other stores in CI's
#: second tier (tests/conftest.py)
FAST_BACKENDS = ("memory",)

FIVE = {f".checkpoints/r1/a{i}.json": f'{{"step": {i}}}'.encode() for i in range(5)}


async def until(cond, what: str, timeout: float = 30) -> None:
    with anyio.fail_after(timeout):
        while not await cond():
            await anyio.sleep(0.02)  # a poll's pace


NEW = {".checkpoints/r2/new.json": b'{"step": 9}'}


def one_root(tmp_path: Path, **settings: object):
    """(work, its .checkpoints root, settings, roots) of a session mirroring that one root."""
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    cps.mkdir(parents=True)
    return (work, cps, *settings_for(work, str(tmp_path / "unused"), reconcile_interval=0, roots=[str(cps)],
                                     **settings))


async def gone_and_back(life: InProcess, work: Path, cps: Path, before_it_goes) -> None:
    """The host writes the five files; once ``before_it_goes()`` returns, the root goes as a whole
    and is made again with :data:`NEW` only; until the five are kept."""
    for key, data in FIVE.items():
        write_atomic(Path(work, key), data)
    await before_it_goes()
    shutil.rmtree(cps)  # the root goes as a whole
    await until(lambda: _false(life.daemon.health.ready), "the root counted as gone")
    for key, data in NEW.items():  # made again by the host, with a new file only
        write_atomic(Path(work, key), data)
    await until(lambda: _true(life.daemon.ledger.kept_keys == set(FIVE)), "the five kept")


async def test_the_points_after_a_root_came_back_keep_the_files_it_lacks(make_store, tmp_path):
    store = await make_store("")
    work, cps, settings, roots = one_root(tmp_path, restore_point_interval=0.2)
    new = NEW  # what the host makes the root with again

    async def pointed(want):
        return await newest_tree(store) == want

    async def host(life: InProcess) -> None:
        await gone_and_back(life, work, cps, lambda: until(lambda: pointed(FIVE), "a point of the five files"))
        await until(lambda: _has(store, new), "a point with the new file")
        tree = await newest_tree(store)
        assert tree == {**FIVE, **new}, f"the newest point dropped what the store keeps: {sorted(tree or ())}"

    assert await run_sync(InProcess(settings, roots, store), host) == 0
    assert await newest_tree(await make_store("")) == {**FIVE, **new}  # the drain's point too (the first store is closed)


async def _false(value: bool) -> bool:
    return not value


async def _true(value: bool) -> bool:
    return value


async def _has(store, files: dict[str, bytes]) -> bool:
    tree = await newest_tree(store) or {}
    return all(tree.get(k) == v for k, v in files.items())


async def test_no_point_lacks_what_the_store_keeps_when_no_earlier_point_holds_it(make_store, tmp_path):
    """The root goes and comes back before the session's first point: the drain's point would be
    a full one without the kept files (nothing to carry them from), so no point is written
    (outside tester, round 2: ``restore --as-of`` of that point, then ``sync``, deleted them)."""
    store = await make_store("")
    work, cps, settings, roots = one_root(tmp_path, restore_point_interval=3600)

    async def host(life: InProcess) -> None:
        stored = lambda: _true(set(FIVE) <= set(life.daemon.known.objects_in({".checkpoints"})))  # noqa: E731
        await gone_and_back(life, work, cps, lambda: until(stored, "five stored"))

    assert await run_sync(InProcess(settings, roots, store), host) == 0
    tree = await newest_tree(await make_store(""))
    assert tree is None or set(FIVE) <= set(tree), f"a point lacks what the store keeps: {sorted(tree or ())}"


async def test_a_skipped_file_is_carried_not_recorded_as_deleted(make_store, tmp_path):
    """A stored file the sidecar now skips (above a lowered SIDECAR_MAX_FILE_SIZE, or unreadable):
    the store keeps it, and so does every point (outside tester, round 2: the next point recorded
    it as deleted)."""
    work, cps, settings, roots = one_root(tmp_path, restore_point_interval=0.2)
    big = {".checkpoints/r1/big.json": b"x" * 5000}

    async def first(life: InProcess) -> None:
        for key, data in {**FIVE, **big}.items():
            write_atomic(Path(work, key), data)
        await until(lambda: _has(life.store, {**FIVE, **big}), "a point with every file")

    assert await run_sync(InProcess(settings, roots, await make_store("")), first) == 0
    new = {".checkpoints/r1/later.json": b'{"step": 10}'}

    async def second(life: InProcess) -> None:
        write_atomic(Path(work, ".checkpoints/r1/big.json"), b"y" * 6000)  # now too large: skipped, the store keeps 5000
        for key, data in new.items():
            write_atomic(Path(work, key), data)
        await until(lambda: _has(life.store, new), "a point with the later file")

    settings, roots = settings_for(work, str(tmp_path / "unused"), restore_point_interval=0.2,
                                   reconcile_interval=0, roots=[str(cps)], max_file_size=1000)
    assert await run_sync(InProcess(settings, roots, await make_store("")), second) == 0
    assert await newest_tree(await make_store("")) == {**FIVE, **big, **new}


async def test_a_skipped_file_is_never_carried_at_a_version_the_store_no_longer_keeps(make_store, tmp_path):
    """A file stored at v2 after the last point, then skipped (too large now): carrying the last
    point's v1 wrote a point that said v1 while the store kept v2, and ``restore --as-of`` of it,
    then ``sync``, overwrote v2 (outside tester, round 3). Only the stored version is carried;
    without it, no point."""
    work, cps, settings, roots = one_root(tmp_path, restore_point_interval=0.2)
    big = ".checkpoints/r1/big.json"

    async def first(life: InProcess) -> None:
        for key, data in {**FIVE, big: b"v1"}.items():
            write_atomic(Path(work, key), data)
        await until(lambda: _has(life.store, {**FIVE, big: b"v1"}), "a point with v1")

    assert await run_sync(InProcess(settings, roots, await make_store("")), first) == 0
    before = await point_keys(await make_store(""))

    async def second(life: InProcess) -> None:
        write_atomic(Path(work, big), b"v2: stored, in no point")
        await until(lambda: _true((life.daemon.known.get(big) or ObjectInfo(big, 0)).size == 23), "v2 stored")
        write_atomic(Path(work, big), b"x" * 6000)  # now too large: skipped, the store keeps v2
        write_atomic(Path(work, ".checkpoints/r1/later.json"), b"later")

    settings, roots = settings_for(work, str(tmp_path / "unused"), restore_point_interval=3600, reconcile_interval=0,
                                   roots=[str(cps)], max_file_size=1000)
    assert await run_sync(InProcess(settings, roots, await make_store("")), second) == 0
    if await point_keys(await make_store("")) != before:  # a point written after v2 was stored
        assert (await newest_tree(await make_store(""))).get(big) != b"v1", "a point says v1 while the store keeps v2"


async def point_keys(store) -> list[str]:
    return sorted([i.key async for i in store.list(".sidecar/points/")])
