"""Versions never depend on the owner marker alone: a claim's generation is above every version
already stored in the namespace. A deleted (or rolled-back) marker, or objects copied in from
another namespace, never leave a new compute's writes "older than stored".

Real ``sync`` processes on both stores (a directory, and Azurite through the real store), one
working directory per compute, as in tests/integration/test_namespaces.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anyio
import pytest

from support import Sidecar, sidecar_env, write_atomic

KEY = ".checkpoints/approval_requests.json"


class Target:
    """One store of the parametrized kind: what it holds, and the operator's tools on it."""

    def __init__(self, kind: str, tmp_path: Path, request) -> None:
        self.azure = None
        if kind == "azure":
            from tests.faults.faultkit import new_target

            self.azure = new_target(request.getfixturevalue("azurite"), "ver")
            self.url = self.azure.store_url
        else:
            self.dir = tmp_path / "store"
            self.url = str(self.dir)

    def env(self, **extra: str) -> dict[str, str]:
        base = self.azure.env(**extra) if self.azure else sidecar_env(**extra)
        base["SIDECAR_STORE"] = self.url
        return base

    def read(self, name: str) -> bytes | None:
        """The bytes stored under the full object name ``name`` (namespace included); None if absent."""
        if self.azure:
            found = self.azure.all_blobs().get(name)
            return None if found is None else found[1]
        p = self.dir / name
        return p.read_bytes() if p.is_file() else None

    def delete(self, name: str) -> None:
        """What an operator does with the storage tools (``az storage blob delete``, ``rm``)."""
        if self.azure:
            anyio.run(self._azure, lambda c: c.delete_blob(name))
        else:
            (self.dir / name).unlink()

    def copy_namespace(self, source: str, dest: str, root: str = ".checkpoints") -> None:
        """A server-side copy of ``source``'s objects of ``root`` into ``dest`` (``az storage blob
        copy start-batch``, ``cp -a``): bytes and metadata (the versions) as they are."""
        if self.azure:
            async def copy(c) -> None:
                async for b in c.list_blobs(name_starts_with=f"{source}/{root}/"):
                    src = c.get_blob_client(b.name)
                    dst = c.get_blob_client(dest + b.name[len(source):])
                    await dst.start_copy_from_url(src.url, requires_sync=True)
            anyio.run(self._azure, copy)
        else:
            for part in (root, f".sidecar-meta/{root}"):
                shutil.copytree(self.dir / source / part, self.dir / dest / part, dirs_exist_ok=True)

    def store(self, namespace: str):
        """The real store client of ``namespace``, as a sidecar makes it."""
        if self.azure:
            from sidecar.store.azure import AzureBlobStore

            return AzureBlobStore.from_url(self.url, namespace, env={"AZURE_STORAGE_CONNECTION_STRING": self.azure.conn})
        from sidecar.store.directory import DirectoryStore

        return DirectoryStore(self.url, namespace)

    async def _azure(self, fn) -> None:
        from azure.storage.blob.aio import ContainerClient

        assert self.azure is not None
        async with ContainerClient.from_connection_string(self.azure.conn, self.azure.container) as c:
            await fn(c)

    def close(self) -> None:
        if self.azure:
            self.azure.drop()


@pytest.fixture(params=["directory", pytest.param("azure", marks=pytest.mark.azure)])
def target(request, tmp_path):
    t = Target(request.param, tmp_path, request)
    yield t
    t.close()


def compute_writes(target: Target, work: Path, data: bytes, **env: str) -> Sidecar:
    """A compute's life: sync (restoring what is stored), the host rewrites KEY, a clean stop."""
    work.mkdir()
    sc = Sidecar(work, "sync", env=target.env(**env))
    sc.wait_event("ready")
    write_atomic(work / KEY, data)
    assert sc.stop() == 0, sc.log()[-3000:]
    return sc


def refused(sc: Sidecar) -> list[dict]:
    return [e for e in sc.events() if e.get("event") == "file_older_than_stored"]


def test_writes_land_after_the_owner_marker_is_deleted(target, tmp_path):
    """The finding: four computes write gen1..gen4, the marker is deleted (an operator freeing the
    namespace), then each of computes 5, 6 and 7 writes: each write must be stored."""
    for n in range(1, 5):
        compute_writes(target, tmp_path / f"c{n}", f"gen{n}".encode(), SIDECAR_PREFIX="agent")
        assert target.read(f"agent/{KEY}") == f"gen{n}".encode()
    target.delete("agent/.sidecar/owner")
    for n in range(5, 8):
        sc = compute_writes(target, tmp_path / f"c{n}", f"gen{n}".encode(), SIDECAR_PREFIX="agent")
        assert not refused(sc), refused(sc)
        assert target.read(f"agent/{KEY}") == f"gen{n}".encode(), f"compute {n}'s write was not stored"
    assert not any(e.get("event") == "fence_generation_lifted" for e in sc.events()), \
        "only the first claim after the loss lifts the generation: the marker is right again"


def test_a_rolled_back_marker_does_not_freeze_a_key(target, tmp_path):
    """The marker restored from an old backup (generation 1) while the objects are of generation 3."""
    compute_writes(target, tmp_path / "c1", b"one", SIDECAR_PREFIX="agent")
    old_marker = target.read("agent/.sidecar/owner")
    assert old_marker is not None
    for n in (2, 3):
        compute_writes(target, tmp_path / f"c{n}", f"gen{n}".encode(), SIDECAR_PREFIX="agent")
    # roll the marker back: delete it and put generation 1's body back with its own version
    target.delete("agent/.sidecar/owner")
    _put_marker(target, "agent", old_marker)
    sc = compute_writes(target, tmp_path / "c4", b"gen4", SIDECAR_PREFIX="agent")
    assert not refused(sc), refused(sc)
    assert target.read(f"agent/{KEY}") == b"gen4"


def test_a_server_side_copy_of_a_namespace_can_be_written_to(target, tmp_path):
    for n in (1, 2, 3):  # namespace a: its objects carry generation 3's versions
        compute_writes(target, tmp_path / f"a{n}", f"a{n}".encode(), SIDECAR_PREFIX="a")
    compute_writes(target, tmp_path / "b1", b"b1", SIDECAR_PREFIX="b")  # b's marker: generation 1
    target.copy_namespace("a", "b")
    assert target.read(f"b/{KEY}") == b"a3"
    sc = compute_writes(target, tmp_path / "b2", b"written in b", SIDECAR_PREFIX="b")
    assert not refused(sc), refused(sc)
    assert target.read(f"b/{KEY}") == b"written in b"
    assert target.read(f"a/{KEY}") == b"a3"  # the source is untouched


def _put_marker(target: Target, namespace: str, body: bytes) -> None:
    """Put an owner marker back as a sidecar stores it (version = its stamp)."""
    from sidecar.fence import OWNER_KEY
    from sidecar.store.base import ObjectMeta

    stamp = json.loads(body)["generation"]
    store = target.store(namespace)

    async def put() -> None:
        await store.open()
        try:
            await store.put(OWNER_KEY, body, ObjectMeta.of(body, stamp, 0o600, version=stamp))
        finally:
            await store.aclose()

    anyio.run(put)
