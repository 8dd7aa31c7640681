"""The directory store cut between a put's two renames (data first, then its metadata record).

The record must not vouch for bytes it was not written for. It is checked against the data file's
size, mtime and inode: a new version of the same size and mtime (a writer that keeps mtimes, a
coarse clock) still has a new inode, so its sha256 is unknown, never the old one's, and a restore
does not refuse the object as corrupt.
"""

from __future__ import annotations

import anyio
import pytest

from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore, _write_atomic

pytestmark = pytest.mark.faults


def test_a_put_cut_after_its_data_rename_leaves_no_wrong_checksum(tmp_path):
    async def main():
        store = DirectoryStore(str(tmp_path / "store"))
        await store.open()
        old, new = b"version 1", b"version 2"  # same size, and the same mtime below
        await store.put("r/a.json", old, ObjectMeta.of(old, 1_700_000_000_000_000_000, 0o600))
        data_path, _meta_path = store._paths("r/a.json")
        _write_atomic(data_path, new, 0o600, 1_700_000_000_000_000_000)  # ... and the process dies here
        data, info = await store.get("r/a.json")
        assert data == new
        assert info.sha256 in (None, ObjectMeta.of(new, 0, 0).sha256)
        assert [i.sha256 async for i in store.list("r/")] == [info.sha256]
        # the next put of the same version repairs the record
        await store.put("r/a.json", new, ObjectMeta.of(new, 1_700_000_000_000_000_000, 0o600))
        assert (await store.get("r/a.json"))[1].sha256 == ObjectMeta.of(new, 0, 0).sha256
        await store.aclose()

    anyio.run(main)
