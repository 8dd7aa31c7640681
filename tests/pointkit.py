"""Restore points for tests, written the way the writer writes them (``sidecar.points``' encoder)
from the per-file objects a store holds, and a store wrapper that counts the requests made."""

from __future__ import annotations

import time
from typing import Any, Iterable

import anyio

from sidecar.points.format import FULL, INCR, PointEntry, PointHeader, encode_point, parse_point_key, point_key, read_point
from sidecar.store.base import NotFound, ObjectInfo, ObjectMeta
from tests.memstore import FakeClock


async def objects(store: Any) -> dict[str, ObjectInfo]:
    """The per-file objects (the sidecar's own ``.sidecar/`` records left out)."""
    return {i.key: i async for i in store.list() if not i.key.startswith(".sidecar/")}


async def point_blob(store: Any, seq: int, keys: Iterable[str], *, base: int | None = None, prev: int | None = None,
                     deleted: Iterable[str] = ()) -> tuple[str, bytes]:
    """The key and bytes of a point holding ``keys`` as the store holds them now (their bytes and
    versions): a full one without ``base``, else an incremental of chain ``base`` after ``prev``."""
    entries, data = [], {}
    for key in sorted(keys):
        body, info = await store.get(key)
        data[key] = body
        entries.append(PointEntry(key, ObjectMeta(len(body), info.sha256, info.mtime_ns, info.mode, info.version)))
    entries += [PointEntry(k, None) for k in sorted(deleted)]
    kind = FULL if base is None else INCR
    base = seq if base is None else base
    header = PointHeader(kind, seq, base, seq if kind == FULL else (prev if prev is not None else base), tuple(entries))
    return point_key(kind, seq, base), encode_point(header, data)


async def put_blob(store: Any, key: str, blob: bytes, version: int = 0) -> ObjectInfo:
    """Store ``blob``; its info as listed (with the store's time, ``modified``)."""
    await store.put(key, blob, ObjectMeta.of(blob, time.time_ns(), 0o600, version))
    return await listed(store, key)


async def listed(store: Any, key: str) -> ObjectInfo:
    return next(i for i in [i async for i in store.list(key)] if i.key == key)


async def write_point(store: Any, seq: int, keys: Iterable[str] | None = None, **kw: Any) -> ObjectInfo:
    """Store a point (see :func:`point_blob`; every per-file object by default); its info."""
    keys = list(await objects(store)) if keys is None else keys
    key, blob = await point_blob(store, seq, keys, **kw)
    return await put_blob(store, key, blob, seq)


async def after(store: Any, t: float | None, deadline: float = 10.0) -> None:
    """Wait until the store's clock is past ``t`` (its Last-Modified has a second's grain on
    Azure): a probe object is written until its time is later. A memory store's fake clock is
    waited on by moving it (its ``sleep``)."""
    assert t is not None
    clock = getattr(store, "clock", None)
    sleep = clock.sleep if isinstance(clock, FakeClock) else anyio.sleep
    with anyio.fail_after(deadline):
        while True:
            info = await put_blob(store, ".sidecar/probe", b"x")
            if info.modified is not None and info.modified > t:
                await store.delete(".sidecar/probe")
                return
            await sleep(0.05)


class Counting:
    """A store that records every request made through it: ``calls`` of (op, key or prefix)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def get(self, key: str) -> Any:
        self.calls.append(("get", key))
        return await self.store.get(key)

    async def get_stream(self, key: str, read_ahead: int = 0) -> Any:
        self.calls.append(("get", key))
        return await self.store.get_stream(key, read_ahead)

    def list(self, prefix: str = "") -> Any:
        self.calls.append(("list", prefix))
        return self.store.list(prefix)

    def gets(self, prefix: str = "") -> list[str]:
        return sorted(k for op, k in self.calls if op == "get" and k.startswith(prefix))


async def newest_tree(store) -> dict[str, bytes] | None:
    """The tree the newest point's chain gives (key -> bytes), None when there is no point."""
    names = []
    async for info in store.list(".sidecar/points/"):
        name = parse_point_key(info.key)
        if name is not None:
            names.append(name)
    if not names:
        return None
    newest = max(names)
    tree: dict[str, bytes] = {}
    for name in sorted(n for n in names if n.base == newest.base and n.seq <= newest.seq):
        try:
            async with await store.get_stream(name.key) as (_, chunks):
                header, files = await read_point(chunks)
        except NotFound:  # deleted by retention since the listing: look again
            return None
        if name.kind == "full":
            tree = {}
        for e in header.entries:
            if e.meta is None:
                tree.pop(e.key, None)
            else:
                tree[e.key] = files[e.key]
    return tree
