"""Pruning one namespace: taken through its owner marker like any owner, deleted whole, marker last.

The protocol (docs/NAMESPACES.md, "Pruning"; the sidecar's side: :func:`sidecar.takeover.take_for_restore`
and :meth:`sidecar.fence.Fence.claim`):

1. Read the marker (the namespace's own store, as its sidecar reads it) and decide again by the
   store's clock (:func:`sidecar.ops.sessionplan.prunable`): what the listing saw may be old. Then
   read what step 5 will delete (:meth:`Pruner._refusal`): a namespace holding what prune cannot
   delete is refused (failed) before anything is written, never left ``deleting``. A dry run
   stops here, having only read; a prune deletes a key that is not there, and a store that
   refuses it (a SAS without delete permission) refuses the namespace the same way.
2. **pending**: a compare-and-swap on the marker as read: a higher stamp, owner ``prune:<uuid>``,
   the same identity, ``"prune": {"phase": "pending"}``. A refused swap: skipped, nothing changed.
3. Wait a **grace** of the fence's write window + margin, the owner's as its marker records them
   when longer than this prune's own (:func:`sidecar.marker.longer_window`; the pending marker
   carries them on): an owner that proved its ownership just before (a stale one still running)
   has sent its last write by then, and a sidecar starting meanwhile takes the namespace over (it
   replaces a pending prune marker before it restores).
4. **deleting**: a compare-and-swap from our pending marker to ``"phase": "deleting"`` (a higher stamp).
   Refused: a sidecar claimed the namespace during the grace: skipped, every object kept. From
   here no sidecar restores or claims it (it waits, or is fenced).
5. Delete every object of the namespace but the marker (those of a nested namespace, one with a
   marker of its own, are left), in batches, each sent right after a **proof** (a marker read:
   still ours) at most one fence window old, like :class:`sidecar.writer.Writer`'s writes.
6. Remove the marker last, conditionally (:meth:`Store.delete_if` on our stamp).

A prune cancelled in step 3 puts the marker it replaced back (:func:`_put_back`): nothing is
deleted yet. A prune that died leaves its marker: a later run finishes it once that marker is ``live_within``
old (``deleting`` goes on deleting at once; ``pending`` starts over).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

import anyio

from sidecar import log
from sidecar.errors import first_of, leaves
from sidecar.marker import (
    OWNER_KEY,
    PRUNE_DELETING,
    PRUNE_OWNER,
    PRUNE_PENDING,
    STORED_VERSION,
    Marker,
    Proof,
    held_stamp,
    later_stamp,
    longer_window,
    marker_identity,
    marker_lineage,
    next_stamp,
    read_marker,
    read_marker_info,
    remove,
    swap,
)
from sidecar.ops.namespaces import Namespace
from sidecar.ops.sessionplan import deleting, owner, prunable
from sidecar.paths import UnsafeKey, validate_relpath
from sidecar.store.base import OWN_NAMESPACE, NotFound, ObjectInfo, Store, StoreError

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
    namespace's own store (not opened), ``now`` the store's clock, ``clock`` the monotonic one
    its proofs are counted on. ``on_pending`` (tests): awaited once the pending marker is
    written, before the grace."""

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
    clock: Callable[[], float] = time.monotonic

    async def prune(self, ns: Namespace) -> Result:
        """Prune ``ns`` if it still may be (see the module docstring). Never raises: whatever goes
        wrong in one namespace (a store error, an object the store will not delete, a bug) is
        that namespace's ``failed`` result, one line, and the run goes on with the others; a
        namespace left ``deleting`` is finished by the next prune (:func:`sidecar.ops.sessionplan.prunable`)."""
        name = ns.group.namespace
        try:
            store = self.store_for(name)
        except Exception as e:  # noqa: BLE001 (a store that cannot be made: this namespace's failure)
            return Result(name, FAILED, why=_reason(e))
        try:
            await store.open()
            return await self._prune(store, ns)
        except Exception as e:  # noqa: BLE001 (Lost, StoreError, or any other: one line, never the run's end)
            return Result(name, FAILED, why=_reason(e))
        finally:
            with contextlib.suppress(Exception):
                await store.aclose()

    async def _prune(self, store: Store, ns: Namespace) -> Result:
        name = ns.group.namespace
        marker, info = await read_marker_info(store)
        if info is None and ns.group.marker is not None:  # listed with one: another prune took it meanwhile
            return Result(name, SKIPPED, why="its owner marker is gone since it was listed (pruned or removed "
                                             "meanwhile): nothing was changed")
        modified = info.modified if info is not None else None
        now = self.now()
        who = owner(marker, modified, now, self.live_within)
        if not prunable(who, ns.group.last_write, marker, modified, now, self.older_than, self.live_within):
            return Result(name, SKIPPED, why=f"its owner is {who} now")
        if (why := await self._refusal(store)) is not None:  # before any marker: a refusal changes nothing
            return Result(name, FAILED, why=f"{why}: nothing was changed")
        if self.dry_run:
            return Result(name, WOULD_PRUNE, ns.group.objects, ns.group.bytes)
        if (why := await _deletes_refused(store)) is not None:
            return Result(name, FAILED, why=f"{why}: nothing was changed")
        identity = marker_identity(marker)
        seen = marker.get(STORED_VERSION, 0)
        stamp = next_stamp(held_stamp(marker))
        # the owner's write window as its marker records it (a pending marker carries it on)
        window, margin = longer_window(marker, self.window, self.margin), self.margin
        ours = Marker(stamp, PRUNE_OWNER + uuid.uuid4().hex, 0.0, identity, window=window, margin=margin,
                      lineage=marker_lineage(marker))
        if not deleting(marker):  # a prune that died deleting goes on at once: nobody restores a half namespace
            if not await _mark(store, ours, stamp, seen, PRUNE_PENDING, info):
                return Result(name, SKIPPED, why="its owner marker changed meanwhile: every object kept")
            try:
                if self.on_pending is not None:
                    await self.on_pending(name)
                await self.sleep(window + margin)
            except BaseException:  # cancelled (Ctrl-C) in the grace: nothing deleted, the marker put back
                with anyio.CancelScope(shield=True), anyio.move_on_after(window + margin):
                    await _put_back(store, stamp, marker)
                raise
            seen, stamp = stamp, later_stamp(stamp)
        if not await _mark(store, ours, stamp, seen, PRUNE_DELETING, None):
            return Result(name, SKIPPED, why="a sidecar claimed it while the prune waited: every object kept")
        objects, size = await self._delete_all(store, stamp, ours.owner)
        if not await remove(store, stamp):
            raise Lost("its objects were deleted, but the owner marker changed before it could be removed")
        return Result(name, PRUNED, objects + 1, size + (info.size if info is not None else 0))

    async def _refusal(self, store: Store) -> str | None:
        """Why the namespace cannot be pruned whole, found by reading what :meth:`_delete_all`
        will delete (a name the store refuses to delete, such as ``a//b``; a nested namespace's
        marker that cannot be looked up, such as a directory standing there), so that it is
        refused before it is marked and never left ``deleting`` halfway; None when it can be."""
        nested: dict[str, bool] = {}
        try:
            async for info in store.list():
                if info.key == OWNER_KEY:
                    if info.leased:  # it could be neither marked nor removed: refused before it is touched
                        return ("refusing to prune it: its owner marker is leased by another client (it cannot be "
                                "rewritten nor deleted); release or break that lease, then prune again")
                    continue
                if await _in_nested(store, info.key, nested):
                    continue  # a nested namespace's: kept
                try:
                    validate_relpath(info.key)
                except UnsafeKey as e:
                    return f"refusing to prune it: it holds a key the store cannot delete ({e}); remove it by hand"
                if info.leased:
                    return (f"refusing to prune it: {log.printable(info.key)!r} is leased by another client (it "
                            "cannot be deleted); release or break its lease")
        except StoreError as e:
            return f"refusing to prune it: what it holds cannot be checked ({e})"
        return None

    async def _delete_all(self, store: Store, stamp: int, ours: str) -> tuple[int, int]:
        """Delete every object but the marker and those of nested namespaces, in batches, each
        right after a proof younger than the window. The objects and bytes deleted."""
        proof = Proof(self.window, self.clock)
        objects = size = 0
        nested: dict[str, bool] = {}
        batch: list[ObjectInfo] = []

        async def flush() -> None:
            nonlocal objects, size
            if not batch:
                return
            if not proof.fresh():
                t = proof.clock()
                current = await read_marker(store)
                if current.get(STORED_VERSION) != stamp or current.get("owner") != ours:
                    raise Lost(f"its owner marker was taken over during the prune ({log.count(objects, 'object')} deleted)")
                proof.proved(t)  # a proof counts from its send
            with first_of(StoreError):  # the namespace's failure, not a group of them
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


def _reason(e: Exception) -> str:
    """A namespace's failure in words: a store's (or a lost marker's) own message; anything else
    (the first exception of a group) named by its type."""
    cause = next(leaves(e))
    if isinstance(cause, (Lost, StoreError)):
        # a store error's "will retry" is the mirroring's promise: prune does not retry a namespace
        return re.sub(r";? will retry( later)?$", "", str(cause)) + ": not retried in this run; prune again"
    return f"{type(cause).__name__}: {cause}"


#: A key no namespace holds, deleted to learn whether the store lets prune delete at all.
DELETE_PROBE = f"{OWN_NAMESPACE}/prune-delete-probe"


async def _deletes_refused(store: Store) -> str | None:
    """Why the store would refuse prune's deletes (a SAS that may write but not delete would
    leave the namespace marked ``deleting`` for good); None when it accepts them. A delete of a
    missing key: on Azure, authorisation is checked before the blob is looked up."""
    try:
        await store.delete(DELETE_PROBE)
    except StoreError as e:
        return f"refusing to prune it: the store refuses to delete there ({e})"
    return None


async def _mark(store: Store, ours: Marker, stamp: int, seen: int, phase: str, expected: ObjectInfo | None) -> bool:
    """Write our prune marker (``ours`` in ``phase``, now) at ``stamp`` if the marker is still at
    version ``seen``."""
    marker = dataclasses.replace(ours, stamp=stamp, heartbeat=time.time(), phase=phase)
    return (await swap(store, marker, stamp, if_version=seen, expected=expected)).version == stamp


async def _put_back(store: Store, stamp: int, marker: dict) -> None:
    """A prune cut short in its grace: the owner marker it replaced (``marker``, as read) written
    again over its pending one (a compare-and-swap on ``stamp``; none: its own removed), so that
    the namespace is as it was: a sidecar resuming a released one need not wait out a write
    window, nor take a pending prune marker for an owner that did not release it. A failure
    leaves the pending marker, which any sidecar replaces (:func:`sidecar.takeover.take_for_restore`)."""
    with contextlib.suppress(StoreError):
        if not marker:
            await remove(store, stamp)
            return
        again = later_stamp(stamp)
        await swap(store, Marker.put_back(marker), again, if_version=stamp)


async def _in_nested(store: Store, key: str, seen: dict[str, bool]) -> bool:
    """Whether ``key`` lies in a nested namespace (a directory above it, inside this namespace,
    has an owner marker). One marker look-up per directory, remembered (a bounded number)."""
    parts = key.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        if parts[i - 1] == OWN_NAMESPACE or parts[i - 1] in ("", ".", ".."):
            return False  # this namespace's own objects (or no directory that can be looked up)
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
        async with await store.get_stream(key):
            return True
    except NotFound:
        return False
