"""The directory store's clean-up of a crashed writer's temp files touches its own namespace only:
many sessions share one store, and a namespace nested below this one's prefix (``a/s1`` below
``a``, or ``a/agent/s2``) is another sidecar's, whose in-flight temp files must survive."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from sidecar.fence import OWNER_KEY
from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore
from sidecar.store.dirfs import TMP_PREFIX

pytestmark = pytest.mark.anyio

STAMP = 1_700_000_000_000_000_000


class _Held:
    """A streamed source that, once its temp file is open, waits for ``release`` before its bytes."""

    def __init__(self, data: bytes, writing: threading.Event, release: threading.Event) -> None:
        self.data, self.size, self.md5 = data, len(data), hashlib.md5(data).digest()
        self.writing, self.release = writing, release

    def iter_sync(self):
        self.writing.set()
        assert self.release.wait(10), "never released"
        yield self.data

    async def chunks(self):  # pragma: no cover - the directory store reads iter_sync
        yield self.data


def temps(where: Path) -> list[str]:
    return sorted(str(p.relative_to(where)) for p in where.rglob(TMP_PREFIX + "*"))


async def test_a_parent_prefix_never_removes_a_nested_namespaces_temp_files(tmp_path):
    base = tmp_path / "store"
    nested = DirectoryStore(str(base), "a/s1")
    await nested.open()
    marker = b'{"generation": 1}'
    await nested.put(OWNER_KEY, marker, ObjectMeta.of(marker, 5, 0o600, version=5))  # its claim
    deeper = DirectoryStore(str(base), "a/agent/s2")
    await deeper.open()
    await deeper.put(OWNER_KEY, marker, ObjectMeta.of(marker, 5, 0o600, version=5))
    # another live writer's temp files in the deeper namespace (its data and its records)
    for where in (base / "a/agent/s2/.checkpoints", base / "a/agent/s2/.sidecar-meta/.checkpoints"):
        where.mkdir(parents=True)
        (where / f"{TMP_PREFIX}0123456789ab").write_bytes(b"in flight")
    # a crash's leftovers in the parent's own namespace, its records and its own objects
    own = [base / "a/.checkpoints" / f"{TMP_PREFIX}aaaaaaaaaaaa", base / "a/.sidecar-meta" / f"{TMP_PREFIX}bbbbbbbbbbbb",
           base / "a/agent/notes" / f"{TMP_PREFIX}cccccccccccc"]
    for leftover in own:
        leftover.parent.mkdir(parents=True, exist_ok=True)
        leftover.write_bytes(b"crashed")

    data = b"a paused workflow " * 1000
    writing, release = threading.Event(), threading.Event()
    got: dict = {}

    async def nested_put() -> None:
        got["info"] = await nested.put(".checkpoints/ctx/c.json", _Held(data, writing, release),
                                       ObjectMeta.of(data, STAMP, 0o600, version=1))

    parent = DirectoryStore(str(base), "a")
    await parent.open()
    async with anyio.create_task_group() as tg:
        tg.start_soon(nested_put)
        try:
            assert await anyio.to_thread.run_sync(writing.wait, 10), "the nested put never started streaming"
            assert temps(base / "a/s1"), "the nested put's temp file"
            await parent.put(".checkpoints/x.json", b"x", ObjectMeta.of(b"x", STAMP, 0o600, version=1))  # it cleans
            left = temps(base / "a/s1")
        finally:
            release.set()
    assert left, "the parent's first put removed a nested namespace's in-flight temp file"
    assert got["info"].version == 1
    assert (await nested.get(".checkpoints/ctx/c.json"))[0] == data
    assert temps(base / "a/agent/s2") == [f".checkpoints/{TMP_PREFIX}0123456789ab",
                                          f".sidecar-meta/.checkpoints/{TMP_PREFIX}0123456789ab"]
    assert not any(p.exists() for p in own), "the parent's own leftovers are still removed"
    assert temps(base / "a/s1") == []
    for s in (nested, deeper, parent):
        await s.aclose()
