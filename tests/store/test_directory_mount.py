"""The directory store's volume unmounted while a sidecar runs (outside tester, round 2): its empty
mount point stands at the store's path. Writing there made a second store (the owner marker
re-created in it, the host's checkpoints uploaded there, its deletes lost for the real one), and
reads there told of nothing stored. Every request checks the directory is the one opened: a
transient error until it is back, then the store goes on."""

from __future__ import annotations

import pytest

from sidecar.store.base import NotFound, ObjectMeta, TransientStoreError
from sidecar.store.directory import DirectoryStore

pytestmark = pytest.mark.anyio


async def test_a_store_whose_volume_went_away_writes_nothing_until_it_is_back(tmp_path):
    path = tmp_path / "mnt" / "store"
    store = DirectoryStore(str(path), "agent/s1")
    await store.open()
    await store.put("ctx/a.json", b"a", ObjectMeta.of(b"a", 1, 0o644, version=1))

    path.rename(tmp_path / "volume")  # unmounted: the empty mount point in its place
    path.mkdir()
    for request in (lambda: store.put("ctx/b.json", b"b", ObjectMeta.of(b"b", 1, 0o644, version=2)),
                    lambda: store.delete("ctx/a.json"), lambda: store.get("ctx/a.json"),
                    lambda: _listed(store)):
        with pytest.raises(TransientStoreError, match="not the directory it was when opened"):
            await request()
    assert list(path.iterdir()) == [], "the store wrote into the empty mount point"

    path.rmdir()
    (tmp_path / "volume").rename(path)  # mounted again
    await store.put("ctx/b.json", b"b", ObjectMeta.of(b"b", 1, 0o644, version=2))
    assert sorted([k async for k in _keys(store)]) == ["ctx/a.json", "ctx/b.json"]
    with pytest.raises(NotFound):
        await store.get("ctx/none.json")
    await store.aclose()


async def _listed(store) -> list:
    return [i async for i in store.list()]


async def _keys(store):
    async for info in store.list("ctx/"):
        yield info.key


async def test_the_same_volume_mounted_again_with_another_device_number_is_the_store(tmp_path, monkeypatch):
    """A network or FUSE volume mounted again gets a new device number (outside tester, round 3:
    the store was never accepted again, mirroring stopped for good): the directory is told by its
    inode, which the same volume keeps and an empty mount point does not share."""
    import os

    import sidecar.store.dirfs as dirfs

    path = tmp_path / "store"
    store = DirectoryStore(str(path), "ns")
    await store.open()
    real = os.stat

    def remounted(p, *a, **k):
        st = real(p, *a, **k)
        if str(p) == str(path):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev + 1, *tuple(st)[3:]))
        return st

    monkeypatch.setattr(dirfs.os, "stat", remounted)
    await store.put("a.json", b"a", ObjectMeta.of(b"a", 1, 0o644, version=1))
    assert (await store.get("a.json"))[0] == b"a"
    await store.aclose()
