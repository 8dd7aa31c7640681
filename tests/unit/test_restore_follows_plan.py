"""The restore applies the plan module's rules (sidecar.restore.plan), not rules of its own: each
rule swapped for another in the plan module, the restore follows the swap. Latest state and
``restore --as-of`` alike, on the contract-tested memory store."""

from __future__ import annotations

import os
from pathlib import Path

import anyio

from sidecar.paths import Root
from sidecar.restore import plan
from sidecar.restore.asof import restore_as_of
from sidecar.restore.latest import restore
from sidecar.restorefs import Lineage, read_lineage
from sidecar.snapshot import Change, bundle_key, encode_bundle
from sidecar.store.base import ObjectMeta
from tests.memstore import MemorySpace
from tests.pointkit import Counting, after, put_blob, write_point

ROOT = ".checkpoints"
KEYS = [f"{ROOT}/{i}.json" for i in range(4)]


async def seeded(with_point: bool = True):
    store = MemorySpace().store()
    await store.open()
    for i, key in enumerate(KEYS):
        data = os.urandom(50 + i)
        await store.put(key, data, ObjectMeta.of(data, 1_700_000_000_000_000_000, 0o600, i + 1))
    point = await write_point(store, 100) if with_point else None
    return store, point


def test_files_come_from_the_point_that_plan_point_source_names(tmp_path, monkeypatch):
    """The point gives a file only when plan.point_source says so; the others come from their objects."""
    real, asked = plan.point_source, []

    def all_but_the_first(listed, tree, **kw):
        asked.append(listed.key)
        return None if listed.key == KEYS[0] else real(listed, tree, **kw)

    async def go(root: Root):
        store, _ = await seeded()
        counting = Counting(store)
        _, result = await restore(counting, [root])
        return result, counting.gets(ROOT)

    result, gets = anyio.run(go, Root(ROOT, str(tmp_path / "a" / ROOT)))
    assert (result.from_points, gets) == (4, [])
    monkeypatch.setattr(plan, "point_source", all_but_the_first)
    result, gets = anyio.run(go, Root(ROOT, str(tmp_path / "b" / ROOT)))
    assert sorted(asked) == KEYS
    assert (result.files, result.from_points, gets) == (4, 3, [KEYS[0]])


def test_a_bundle_decides_the_files_that_plan_bundle_wins_gives_it(tmp_path, monkeypatch):
    """The bundle's newer bytes replace the stored object only when plan.bundle_wins says so."""
    async def go(root: Root) -> bytes:
        store, _ = await seeded(with_point=False)
        changes = [Change(KEYS[0], b"from the bundle", ObjectMeta.of(b"from the bundle", 2, 0o600))]
        await put_blob(store, bundle_key(ROOT), encode_bundle(ROOT, changes), version=10)
        await restore(store, [root])
        return (Path(root.path) / "0.json").read_bytes()

    assert anyio.run(go, Root(ROOT, str(tmp_path / "a" / ROOT))) == b"from the bundle"
    monkeypatch.setattr(plan, "bundle_wins", lambda *a: False)
    assert anyio.run(go, Root(ROOT, str(tmp_path / "b" / ROOT))) != b"from the bundle"


def test_the_finish_records_what_plan_plan_finish_and_plan_as_of_finish_say(tmp_path, monkeypatch):
    """The roots are flushed, recorded and unmarked as the plan's Finish says, whichever restore
    ran: a Finish that names no root leaves them marked (cut short, as far as the next start knows)
    and unrecorded."""
    nothing = plan.Finish([], [], [])
    monkeypatch.setattr(plan, "plan_finish", lambda *a: nothing)
    monkeypatch.setattr(plan, "plan_as_of_finish", lambda *a: nothing)

    async def go():
        store, point = await seeded()
        latest = Root(ROOT, str(tmp_path / "latest" / ROOT))
        await restore(store, [latest])
        await after(store, point.modified)
        as_of = Root(ROOT, str(tmp_path / "asof" / ROOT))
        lineage = Lineage(store.description, "", 0)
        done = await restore_as_of(store, [as_of], point.modified, None, force=False, lineage=lineage)
        return latest, as_of, done

    latest, as_of, done = anyio.run(go)
    assert done.files == 4
    for root in (latest, as_of):
        assert len(os.listdir(root.path)) == 5  # the files, and the marker
        assert (Path(root.path) / ".sidecar-restoring").exists() and read_lineage(root) is None
