"""Pruning one namespace: taken through its owner marker like any owner, deleted whole, marker last.

The protocol (docs/NAMESPACES.md, "Pruning"; the sidecar's side: :func:`sidecar.fence.take_for_restore`
and :meth:`sidecar.fence.Fence.claim`):

1. Read the marker (the namespace's own store, as its sidecar reads it) and decide again by the
   store's clock (:func:`sidecar.sessionplan.prunable`): what the listing saw may be old.
2. **pending**: a compare-and-swap on the marker as read: a higher stamp, owner ``prune:<uuid>``,
   the same identity, ``"prune": {"phase": "pending"}``. A refused swap: skipped, nothing changed.
3. Wait a **grace** of the fence's write window + margin: an owner that proved its ownership just
   before (a stale one still running) has sent its last write by then, and a sidecar starting
   meanwhile takes the namespace over (it replaces a pending prune marker before it restores).
4. **deleting**: a compare-and-swap from our pending marker to ``"phase": "deleting"`` (a higher stamp).
   Refused: a sidecar claimed the namespace during the grace: skipped, every object kept. From
   here no sidecar restores or claims it (it waits, or is fenced).
5. Delete every object of the namespace but the marker (those of a nested namespace, one with a
   marker of its own, are left), in batches, each sent right after a **proof** (a marker read:
   still ours) at most one fence window old, like :class:`sidecar.writer.Writer`'s writes.
6. Remove the marker last, conditionally (:meth:`Store.delete_if` on our stamp).

A prune that died leaves its marker: a later run finishes it once that marker is ``live_within``
old (``deleting`` goes on deleting at once; ``pending`` starts over).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

import anyio

from sidecar.fence import (
    OWNER_KEY,
    PRUNE_DELETING,
    PRUNE_FIELD,
    PRUNE_OWNER,
    PRUNE_PENDING,
    STORED_VERSION,
    _stamp,
    later_stamp,
    marker_identity,
    next_stamp,
    read_marker,
    read_marker_info,
)
from sidecar.namespaces import Namespace
from sidecar.sessionplan import deleting, owner, prunable
from sidecar.store.base import OWN_NAMESPACE, NotFound, ObjectInfo, ObjectMeta, Store, StoreError

#: What happened to a namespace.
PRUNED, WOULD_PRUNE, SKIPPED, FAILED = "pruned", "would prune", "skipped", "failed"


@dataclass
class Result:
    namespace: str  # relative to the store's prefix
    outcome: str  # PRUNED, WOULD_PRUNE, SKIPPED, FAILED
    objects: int = 0
    bytes: int = 0
    why: str = ""


class Lost(Exception):
    """The marker is no longer this prune's (another prune, or ``release``, took it)."""


@dataclass
class Pruner:
    """Prunes namespaces one by one (:meth:`prune`); ``store_for(namespace)`` makes the
    namespace's own store (not opened), ``now`` the store's clock. ``on_pending`` (tests): awaited
    once the pending marker is written, before the grace."""

    store_for: Callable[[str], Store]
    now: Callable[[], float]
    window: float
    margin: float
    older_than: float
    live_within: float
    dry_run: bool = False
    batch: int = 16
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep
    on_pending: Callable[[str], Awaitable[None]] | None = None

    async def prune(self, ns: Namespace) -> Result:
        """Prune ``ns`` if it still may be (see the module docstring); never raises StoreError."""
        name = ns.group.namespace
        store = self.store_for(name)
        try:
            await store.open()
            return await self._prune(store, ns)
        except Lost as e:
            return Result(name, FAILED, why=str(e))
        except StoreError as e:
            return Result(name, FAILED, why=str(e))
        finally:
            await store.aclose()

    async def _prune(self, store: Store, ns: Namespace) -> Result:
        name = ns.group.namespace
        marker, info = await read_marker_info(store)
        modified = info.modified if info is not None else None
        now = self.now()
        who = owner(marker, modified, now, self.live_within)
        if not prunable(who, ns.group.last_write, marker, modified, now, self.older_than, self.live_within):
            return Result(name, SKIPPED, why=f"its owner is {who} now")
        if self.dry_run:
            return Result(name, WOULD_PRUNE, ns.group.objects, ns.group.bytes)
        ours = PRUNE_OWNER + uuid.uuid4().hex
        identity = marker_identity(marker)
        seen = marker.get(STORED_VERSION, 0)
        stamp = next_stamp(max(_stamp(marker.get("generation")), _stamp(seen)))
        if not deleting(marker):  # a prune that died deleting goes on at once: nobody restores a half namespace
            if not await _mark(store, stamp, seen, ours, identity, PRUNE_PENDING, info):
                return Result(name, SKIPPED, why="its owner marker changed meanwhile: every object kept")
            if self.on_pending is not None:
                await self.on_pending(name)
            await self.sleep(self.window + self.margin)
            seen, stamp = stamp, later_stamp(stamp)
        if not await _mark(store, stamp, seen, ours, identity, PRUNE_DELETING, None):
            return Result(name, SKIPPED, why="a sidecar claimed it while the prune waited: every object kept")
        objects, size = await self._delete_all(store, stamp, ours)
        if not await store.delete_if(OWNER_KEY, stamp):
            raise Lost("its objects were deleted, but the owner marker changed before it could be removed")
        return Result(name, PRUNED, objects + 1, size + (info.size if info is not None else 0))

    async def _delete_all(self, store: Store, stamp: int, ours: str) -> tuple[int, int]:
        """Delete every object but the marker and those of nested namespaces, in batches, each
        right after a proof younger than the window. The objects and bytes deleted."""
        proof_until = 0.0
        objects = size = 0
        nested: dict[str, bool] = {}
        batch: list[ObjectInfo] = []

        async def flush() -> None:
            nonlocal proof_until, objects, size
            if not batch:
                return
            t = time.monotonic()
            if t >= proof_until:
                current = await read_marker(store)
                if current.get(STORED_VERSION) != stamp or current.get("owner") != ours:
                    raise Lost(f"its owner marker was taken over during the prune ({objects} objects deleted)")
                proof_until = t + self.window  # a proof counts from its send
            async with anyio.create_task_group() as tg:
                for info in batch:
                    tg.start_soon(store.delete, info.key)
            objects += len(batch)
            size += sum(max(i.size, 0) for i in batch)
            batch.clear()

        async for info in store.list():
            if info.key == OWNER_KEY or await _in_nested(store, info.key, nested):
                continue
            batch.append(info)
            if len(batch) >= self.batch:
                await flush()
        await flush()
        return objects, size


async def _mark(store: Store, stamp: int, seen: int, ours: str, identity: dict[str, str], phase: str,
                expected: ObjectInfo | None) -> bool:
    """Write our prune marker at ``stamp`` if the marker is still at version ``seen``."""
    body: dict = {"generation": stamp, "owner": ours, "heartbeat": time.time(), PRUNE_FIELD: {"phase": phase}}
    if identity:
        body["identity"] = identity
    data = json.dumps(body).encode()
    put = await store.put(OWNER_KEY, data, ObjectMeta.of(data, stamp, 0o600, version=stamp), if_version=seen,
                          expected=expected)
    return put.version == stamp


async def _in_nested(store: Store, key: str, seen: dict[str, bool]) -> bool:
    """Whether ``key`` lies in a nested namespace (a directory above it, inside this namespace,
    has an owner marker). One marker look-up per directory, remembered (a bounded number)."""
    parts = key.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        if parts[i - 1] == OWN_NAMESPACE:
            return False  # this namespace's own objects
        where = "/".join(parts[:i])
        if where not in seen:
            if len(seen) >= 4096:
                seen.clear()
            seen[where] = await _exists(store, f"{where}/{OWNER_KEY}")
        if seen[where]:
            return True
    return False


async def _exists(store: Store, key: str) -> bool:
    try:
        _, chunks = await store.get_stream(key)
    except NotFound:
        return False
    close = getattr(chunks, "aclose", None)
    if close is not None:
        await close()
    return True
