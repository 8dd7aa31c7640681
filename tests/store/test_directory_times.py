"""A directory-store object's ``modified`` (what ``restore --as-of`` picks restore points by and
``history`` shows) is when the store wrote it: stable, whatever later touches the file's inode
(a chmod, a rename, a copy tool setting its metadata), all of which change its change time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore

pytestmark = pytest.mark.anyio

DEADLINE_TOUCHES = 1_000_000


def touch_until_ctime_moves(path: Path, touch) -> None:
    """Touch ``path``'s inode until its change time differs (the kernel's timestamps are coarse:
    a touch in the same tick leaves it as it was); a poll with a bound, not a sleep."""
    before = path.stat().st_ctime_ns
    for _ in range(DEADLINE_TOUCHES):
        touch(path)
        if path.stat().st_ctime_ns != before:
            return
    raise AssertionError(f"{path}: its change time never moved")


def rename_there_and_back(path: Path) -> None:
    aside = path.with_name(path.name + ".aside")
    os.rename(path, aside)
    os.rename(aside, path)


@pytest.mark.parametrize("touch", [lambda p: os.chmod(p, 0o640), rename_there_and_back,
                                   lambda p: os.utime(p, ns=(5, 5))], ids=["chmod", "rename", "utime"])
async def test_an_objects_modified_is_when_the_store_wrote_it_not_its_last_inode_change(tmp_path, touch):
    store = DirectoryStore(str(tmp_path / "store"), "ns")
    await store.open()
    data = b"a checkpoint"
    put = await store.put("ctx/c.json", data, ObjectMeta.of(data, 1, 0o600, version=1))
    own = b'{"generation": 1}'
    await store.put(".sidecar/owner", own, ObjectMeta.of(own, 7, 0o600, version=7))
    listed = {i.key: i.modified async for i in store.list()}
    for key in listed:
        touch_until_ctime_moves(tmp_path / "store" / "ns" / key, touch)
    assert {i.key: i.modified async for i in store.list()} == listed
    assert put.modified is not None and listed["ctx/c.json"] == put.modified
    assert (await store.get("ctx/c.json"))[1].modified == put.modified
    await store.aclose()
