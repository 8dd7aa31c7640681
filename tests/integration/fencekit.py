"""A store of either kind (a directory, Azurite) for the fence tests, with the operator's tools:
read, delete, a server-side copy, and the real store client."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import anyio
import pytest

from support import Sidecar, sidecar_env


class Target:
    """One store of the parametrized kind: what it holds, and the operator's tools on it."""

    def __init__(self, kind: str, tmp_path: Path, request) -> None:
        #: the sidecars started on this store: those still running at the end are killed (a
        #: failing test leaves no process behind)
        self.started: list[Sidecar] = []
        self.azure = None
        if kind == "azure":
            from tests.faults.faultkit import new_target

            self.azure = new_target(request.getfixturevalue("azurite"), "ver")
            self.url = self.azure.store_url
        else:
            self.dir = tmp_path / "store"
            self.dir.mkdir()  # a mounted volume exists: on a platform a missing one is refused
            self.url = str(self.dir)

    def env(self, **extra: str) -> dict[str, str]:
        base = self.azure.env(**extra) if self.azure else sidecar_env(**extra)
        base["SIDECAR_STORE"] = self.url
        return base

    def start(self, cwd: Path, *args: str, env: dict[str, str]) -> Sidecar:
        """A sidecar process on this store (``env``: from :meth:`env`)."""
        sc = Sidecar(cwd, *args, env=env)
        self.started.append(sc)
        return sc

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
        from sidecar.store import make_store

        return make_store(self.url, namespace, env={"AZURE_STORAGE_CONNECTION_STRING": self.azure.conn} if self.azure else {})

    def put(self, namespace: str, key: str, body: bytes, version: int) -> int:
        """Write ``key`` of ``namespace`` at ``version`` with the real store client, as a sidecar
        of that version would (or a hand-edited store); the version the store then holds."""
        import anyio

        from sidecar.store.base import ObjectMeta

        async def go() -> int:
            store = self.store(namespace)
            await store.open()
            try:
                info = await store.put(key, body, ObjectMeta.of(body, 1_700_000_000_000_000_000, 0o600, version=version))
            finally:
                await store.aclose()
            return info.version

        return anyio.run(go)

    async def _azure(self, fn) -> None:
        from azure.storage.blob.aio import ContainerClient

        assert self.azure is not None
        async with ContainerClient.from_connection_string(self.azure.conn, self.azure.container) as c:
            await fn(c)

    def close(self) -> None:
        for sc in self.started:
            if sc.proc.poll() is None:
                sc.kill()
        if self.azure:
            self.azure.drop()


#: The parameters of a test module's ``target`` fixture: both stores.
KINDS = ["directory", pytest.param("azure", marks=pytest.mark.azure)]


def make_target(request, tmp_path: Path) -> Iterator[Target]:
    """The body of a ``target`` fixture parametrized with :data:`KINDS`."""
    t = Target(request.param, tmp_path, request)
    yield t
    t.close()

