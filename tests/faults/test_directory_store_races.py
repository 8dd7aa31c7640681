"""The directory store under concurrent operations on neighbouring keys.

A delete prunes the directories it leaves empty; a put of a neighbour in the same directory must
never fail because of that (the uploader runs operations on different keys at once). Deterministic:
the delete is run from inside the put, at the step where the race bites.
"""

from __future__ import annotations

import anyio
import anyio.from_thread
import pytest

import sidecar.store.directory as directory_mod
from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore

pytestmark = pytest.mark.faults

STAMP = 1_700_000_000_000_000_000


def test_a_replace_survives_a_neighbours_delete_pruning_the_record_directory(tmp_path, monkeypatch):
    old, new, other = b"version 1", b"version 2!", b"neighbour"

    async def main():
        store = DirectoryStore(str(tmp_path / "store"))
        await store.open()
        await store.put("r/a.json", old, ObjectMeta.of(old, STAMP, 0o600))
        await store.put("r/b.json", other, ObjectMeta.of(other, STAMP, 0o600))
        _data, meta_path = store._paths("r/a.json")
        real = directory_mod._fsync_dir
        raced = []

        def delete_first(path):
            # The put has just removed a.json's old record: b.json's delete now empties (and
            # prunes) the records' directory before the put syncs it.
            if not raced and path == str(tmp_path / "store" / directory_mod.META_DIR / "r"):
                raced.append(path)
                anyio.from_thread.run(store.delete, "r/b.json")
            return real(path)

        monkeypatch.setattr(directory_mod, "_fsync_dir", delete_first)
        await store.put("r/a.json", new, ObjectMeta.of(new, STAMP + 1, 0o600))
        assert raced, "the race was not set up: the put no longer syncs the records' directory there"
        data, info = await store.get("r/a.json")
        assert data == new and info.sha256 == ObjectMeta.of(new, 0, 0).sha256
        assert [i.key async for i in store.list("r/")] == ["r/a.json"]
        await store.aclose()

    anyio.run(main)
