"""The directory store cut between a put's data rename and its metadata record.

The record must not vouch for bytes it was not written for, even when the new version has the
old one's size and mtime (a writer that keeps mtimes, a coarse clock): the object's sha256 must
read as unknown, never the old version's, or a restore would refuse the object as corrupt.
Deterministic: the record's write fails as if the process had died there.
"""

from __future__ import annotations

import shutil

import anyio
import pytest

import sidecar.store.directory as directory_mod
from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore

pytestmark = pytest.mark.faults

STAMP = 1_700_000_000_000_000_000


class Died(BaseException):
    pass


def test_a_put_cut_after_its_data_rename_leaves_no_wrong_checksum(tmp_path, monkeypatch):
    old, new = b"version 1", b"version 2"  # same size, same mtime

    async def main():
        store = DirectoryStore(str(tmp_path / "store"))
        await store.open()
        await store.put("r/a.json", old, ObjectMeta.of(old, STAMP, 0o600))
        _data_path, meta_path = store._paths("r/a.json")
        real = directory_mod._write_atomic

        def dies_at_the_record(path, *a, **k):
            if path == meta_path:
                raise Died()
            return real(path, *a, **k)

        monkeypatch.setattr(directory_mod, "_write_atomic", dies_at_the_record)
        with pytest.raises(Died):
            await store.put("r/a.json", new, ObjectMeta.of(new, STAMP, 0o600))
        monkeypatch.setattr(directory_mod, "_write_atomic", real)

        data, info = await store.get("r/a.json")
        assert data == new
        assert info.sha256 is None, "the old version's record vouches for the new bytes"
        assert [i.sha256 async for i in store.list("r/")] == [None]
        # the next put of the same version repairs the record
        await store.put("r/a.json", new, ObjectMeta.of(new, STAMP, 0o600))
        assert (await store.get("r/a.json"))[1].sha256 == ObjectMeta.of(new, 0, 0).sha256
        await store.aclose()

    anyio.run(main)


def test_a_copied_store_keeps_its_checksums(tmp_path):
    """A store directory copied elsewhere (`cp -a`, rsync, a backup restored): every record still
    vouches for its object, and a stale write is still refused."""
    data = b"checkpoint"

    async def main():
        store = DirectoryStore(str(tmp_path / "store"))
        await store.open()
        await store.put("r/a.json", data, ObjectMeta.of(data, STAMP, 0o600, version=2))
        await store.aclose()
        shutil.copytree(tmp_path / "store", tmp_path / "copy", symlinks=True)
        copy = DirectoryStore(str(tmp_path / "copy"))
        await copy.open()
        assert (await copy.get("r/a.json"))[1].sha256 == ObjectMeta.of(data, 0, 0).sha256
        older = b"older one"
        info = await copy.put("r/a.json", older, ObjectMeta.of(older, STAMP - 1, 0o600, version=1))
        assert info.version == 2 and (await copy.get("r/a.json"))[0] == data
        await copy.aclose()

    anyio.run(main)


def test_an_older_owner_marker_is_refused_while_the_record_is_being_replaced(tmp_path):
    """Between a replacement's removal of the old record and its new one, the object has no
    record; the stamp on the sidecar's own objects (the fence's owner marker) must still hold,
    or an older sidecar's marker would be accepted in that moment."""
    from sidecar.marker import OWNER_KEY

    marker = b'{"generation": 2}'
    older = b'{"generation": 1}'

    async def main():
        store = DirectoryStore(str(tmp_path / "store"))
        await store.open()
        await store.put(OWNER_KEY, marker, ObjectMeta.of(marker, 2 << 32, 0o600, version=2 << 32))
        _data_path, meta_path = store._paths(OWNER_KEY)
        directory_mod._remove_durably(meta_path, store.top)  # a replacement of it under way
        info = await store.put(OWNER_KEY, older, ObjectMeta.of(older, 1 << 32, 0o600, version=1 << 32))
        assert info.version == 2 << 32, "an older marker was accepted"
        assert (await store.get(OWNER_KEY))[0] == marker
        await store.aclose()

    anyio.run(main)
