"""The sidecar in this process: a :class:`~sidecar.lifecycle.Lifecycle` on a store the test
chooses, and a store that records every mutation so that a crash after any one of them can be
replayed (crash consistency by enumeration).

Rules are tested here rather than through a process: no interpreter start, no signals, no log
polling; a test waits on the lifecycle's own state (:func:`mirroring`) or on the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import anyio

from sidecar.config import load
from sidecar.lifecycle import Lifecycle, Shutdown
from sidecar.store.base import ObjectInfo, ObjectMeta, Store
from sidecar.store.directory import DirectoryStore
from support import sidecar_env


def settings_for(work: Path, store: str, **overrides: object):
    """(settings, roots) as ``sync --store STORE`` started in ``work`` would load them."""
    return load({"store": store, **overrides}, cwd=str(work), env=sidecar_env())


class InProcess(Lifecycle):
    """A Lifecycle whose store is the one given (a test double, or a wrapper of a real one)."""

    def __init__(self, settings, roots, store: Store, shutdown: Shutdown | None = None, cmd=None) -> None:
        super().__init__(settings, roots, cmd=cmd, shutdown=shutdown)
        self._given = store

    def open_store(self) -> Store:
        self.store = self._given
        return self.store


async def mirroring(life: InProcess, timeout: float = 30) -> None:
    """Until ``life`` mirrors (its start-up restore done, the watch in place): its readiness."""
    with anyio.fail_after(timeout):
        while not (hasattr(life, "daemon") and life.daemon.health.ready):
            await anyio.sleep(0.005)  # a poll's pace


async def run_sync(life: InProcess, body: Callable[[InProcess], Awaitable[None]]) -> int:
    """Run ``life`` (``sync``) with ``body`` beside it once it mirrors; shut it down when ``body``
    returns; its exit code."""
    codes: list[int] = []

    async def main() -> None:
        codes.append(await life.main())

    async with anyio.create_task_group() as tg:
        tg.start_soon(main)
        await mirroring(life)
        try:
            await body(life)
        finally:
            life.shutdown.trigger("test")
    return codes[0]


@dataclass
class Mutation:
    """One store mutation that landed, with what it wrote (bytes, even for a streamed put)."""

    op: str  # put, delete, delete_if
    key: str
    data: bytes = b""
    meta: ObjectMeta | None = None
    if_version: int | None = None
    version: int = 0  # delete_if's

    def __str__(self) -> str:
        return f"{self.op} {self.key}" + (f" v{self.meta.version}" if self.meta else "")


class RecordingStore(DirectoryStore):
    """A directory store that records every mutation it carries out, in the order they land."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.log: list[Mutation] = []

    async def put(self, key: str, data, meta: ObjectMeta, if_version: int | None = None, *,
                  expected: ObjectInfo | None = None) -> ObjectInfo:
        if not isinstance(data, bytes):  # a Source: read it as the store would (it raises if it changed)
            data = b"".join([chunk async for chunk in data.chunks()])
        info = await super().put(key, data, meta, if_version, expected=expected)
        if info.version == meta.version and info.sha256 == meta.sha256:  # landed (not superseded, not refused)
            self.log.append(Mutation("put", key, data, meta, if_version))
        return info

    async def delete(self, key: str) -> None:
        await super().delete(key)
        self.log.append(Mutation("delete", key))

    async def delete_if(self, key: str, version: int) -> bool:
        done = await super().delete_if(key, version)
        if done:
            self.log.append(Mutation("delete_if", key, version=version))
        return done


async def replay(log: list[Mutation], path: str) -> None:
    """The store a crash right after ``log``'s last mutation leaves: each one applied again, in order."""
    store = DirectoryStore(path)
    await store.open()
    try:
        for m in log:
            if m.op == "put":
                assert m.meta is not None
                await store.put(m.key, m.data, m.meta, m.if_version)
            elif m.op == "delete":
                await store.delete(m.key)
            else:
                await store.delete_if(m.key, m.version)
    finally:
        await store.aclose()

