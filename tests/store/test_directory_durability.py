"""The directory store's writes survive a power loss: a file is fsynced, renamed and its directory
fsynced, and every directory the store makes on the way is fsynced in its parent (POSIX makes a new
entry durable only then), the records' directories included."""

from __future__ import annotations

import os

import pytest

import sidecar.store.directory as directory
import sidecar.store.dirfs as dirfs
from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore

pytestmark = pytest.mark.anyio


async def test_every_directory_a_put_makes_is_fsynced_in_its_parent(tmp_path, monkeypatch):
    store = DirectoryStore(str(tmp_path / "store"), "ns")
    await store.open()
    await store.put("first.json", b"x", ObjectMeta.of(b"x", 1, 0o644, version=1))  # the namespace's own dirs
    synced: list[str] = []
    real = dirfs._fsync_dir

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(dirfs, "_fsync_dir", recording)
    monkeypatch.setattr(directory, "_fsync_dir", recording)
    await store.put("a/b/c.json", b"data", ObjectMeta.of(b"data", 1, 0o644, version=2))
    top = str(tmp_path / "store" / "ns")
    for made in ("a", "a/b", ".sidecar-meta/a", ".sidecar-meta/a/b"):
        parent = os.path.dirname(os.path.join(top, made))
        assert parent in synced, f"{made}: its parent {parent} was never fsynced after it was made ({synced})"
    assert os.path.join(top, "a/b") in synced  # the data's own directory, after the rename
    await store.aclose()
