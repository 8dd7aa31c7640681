"""Crash-consistent commits for roots whose files depend on each other (the AgentServer state root).

The host rewrites ``checkpoints`` and then ``workflow bindings`` (which points into the former) at
every superstep; a store holding the new bindings with the old checkpoints cannot be resumed. In
snapshot mode the store therefore only ever holds a state the disk really passed through:

1. **Snapshot.** Scan the root (size, mtime, ctime, inode of every file), read every dirty file,
   scan again. Equal scans mean nothing changed in between, so what was read is exactly the disk's
   state at one instant. Otherwise the batch is read again (the host's next write is coming).
2. **Commit.** A batch of one change is a single atomic put or delete. A larger batch is first
   written as one *bundle* object (``.sidecar/bundles/<root>``: every changed file and deletion),
   then applied to the per-file objects, then the bundle is deleted. A crash after the bundle put
   leaves the bundle behind, and restore lays it over the per-file objects: either the old state or
   the new one is restorable, never a mix.

Encoding and decoding bundles are pure (:func:`encode_bundle`, :func:`decode_bundle`). A
:class:`Committer` carries out the protocol for the uploader, which hands it each root's batch of
dirty keys and retries a batch that failed; it also deletes, at start-up, the bundles that
cut-short commits left behind (:meth:`Committer.drop_stale_bundles`). Per root, a commit's bundle
put..delete and that cleanup's delete never interleave (a lock per root).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Awaitable, Callable

import anyio
import anyio.to_thread

from sidecar import log
from sidecar.known import StoreState
from sidecar.localfs import Unstable, Vanished, absent, read_stable, scan_root
from sidecar.metrics import Totals
from sidecar.paths import IgnoreRules, Root, split_key
from sidecar.store.base import OWN_NAMESPACE, NotFound, ObjectMeta, Store, StoreError

BUNDLE_DIR = f"{OWN_NAMESPACE}/bundles"


def bundle_key(root_name: str) -> str:
    return f"{BUNDLE_DIR}/{root_name}"


@dataclass(frozen=True)
class Change:
    key: str
    data: bytes | None  # None: deleted
    meta: ObjectMeta | None

    @property
    def written(self) -> ObjectMeta:
        """The metadata of a change that writes (``data`` is not None)."""
        assert self.meta is not None, f"{self.key} is a deletion"
        return self.meta


def encode_bundle(root_name: str, changes: list[Change]) -> bytes:
    header = {
        "version": 1,
        "root": root_name,
        "entries": [
            {"key": c.key, "deleted": True} if c.data is None else
            {"key": c.key, "size": c.written.size, "sha256": c.written.sha256, "mtime_ns": c.written.mtime_ns,
             "mode": c.written.mode}
            for c in changes
        ],
    }
    return json.dumps(header, separators=(",", ":")).encode() + b"\n" + b"".join(
        c.data for c in changes if c.data is not None
    )


class BundleError(ValueError):
    pass


def decode_bundle(blob: bytes) -> tuple[str, list[Change]]:
    """The root and changes a bundle holds; :class:`BundleError` for anything else (a bundle is
    read from the store, so its content is checked, never trusted)."""
    try:
        head, _, body = blob.partition(b"\n")
        header = json.loads(head)
        if not isinstance(header, dict):
            raise BundleError("unreadable bundle: the header is not an object")
        if header.get("version") != 1:
            raise BundleError(f"unknown bundle version {header.get('version')!r}")
        root, entries = header["root"], header["entries"]
        if not isinstance(root, str) or not isinstance(entries, list):
            raise BundleError("unreadable bundle: malformed header")
        changes, offset = [], 0
        for e in entries:
            if not isinstance(e, dict) or not isinstance(e.get("key"), str):
                raise BundleError("unreadable bundle: malformed entry")
            if e.get("deleted"):
                changes.append(Change(e["key"], None, None))
                continue
            size = e["size"]
            if not _is_int(size) or size < 0 or offset + size > len(body):
                raise BundleError(f"unreadable bundle: entry {e['key']!r} has a bad size")
            if not (_is_int(e["mtime_ns"]) and _is_int(e["mode"]) and isinstance(e["sha256"], str)):
                raise BundleError(f"unreadable bundle: entry {e['key']!r} is malformed")
            data = body[offset : offset + size]
            offset += size
            meta = ObjectMeta(size, e["sha256"], e["mtime_ns"], e["mode"])
            if ObjectMeta.of(data, meta.mtime_ns, meta.mode).sha256 != meta.sha256:
                raise BundleError(f"bundle entry {e['key']!r} does not match its sha256")
            changes.append(Change(e["key"], data, meta))
        if offset != len(body):
            raise BundleError("unreadable bundle: bytes beyond its entries")
        return root, changes
    except BundleError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise BundleError(f"unreadable bundle: {e}") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def fetch_bundle(store: Store, root_name: str) -> list[Change] | None:
    """The root's outstanding bundle, or None."""
    try:
        blob, _ = await store.get(bundle_key(root_name))
    except NotFound:
        return None
    _, changes = decode_bundle(blob)
    return changes


class Committer:
    """Commits batches of snapshot roots by the protocol above, against ``known`` (what the store is
    known to hold, kept current here). Before every write it awaits ``guard`` (the fence's proof of
    ownership, which never returns once fenced) and stamps the write with ``version()``."""

    def __init__(self, store: Store, roots: list[Root], ignore: IgnoreRules, known: StoreState, *,
                 max_file_size: int, guard: Callable[[], Awaitable[None]], version: Callable[[], int],
                 totals: Totals) -> None:
        self.store = store
        self.roots_by_name = {r.name: r for r in roots}
        self.ignore = ignore
        self.known = known
        self.max_file_size = max_file_size
        self.guard = guard
        self.version = version
        self.totals = totals
        #: per root: a commit's bundle put..delete and the start-up cleanup's delete never interleave
        self._locks: dict[str, anyio.Lock] = {}

    def _lock(self, root_name: str) -> anyio.Lock:
        return self._locks.setdefault(root_name, anyio.Lock())

    async def commit(self, root: Root, keys: list[str]) -> bool:
        """Commit ``keys`` of ``root`` as one consistent state; False when the disk moved."""

        def snapshot() -> list[Change] | None:
            before, _ = scan_root(root, self.ignore)
            changes = []
            for key in sorted(keys):
                if key in before:
                    _, parts = split_key(key, self.roots_by_name)
                    try:
                        data, meta = read_stable(root, parts, self.max_file_size)
                    except (Vanished, Unstable):
                        return None
                    changes.append(Change(key, data, meta))
                elif key in self.known and absent(root, key.split("/", 1)[1]):
                    changes.append(Change(key, None, None))  # gone for sure: not merely unreadable
            after, _ = scan_root(root, self.ignore)
            return changes if after == before else None

        changes = await anyio.to_thread.run_sync(snapshot)
        if changes is None:
            return False
        changes = [c for c in changes if c.data is None or not (
            (info := self.known.get(c.key)) is not None and info.same_as(c.written))]
        async with self._lock(root.name):
            await self._apply(root, changes)
        log.debug("snapshot_committed", root=root.name, changes=len(changes))
        return True

    async def _apply(self, root: Root, changes: list[Change]) -> None:
        # Every write proves ownership (free within the fence's window): a large commit can outlast
        # one proof, and a newer owner's objects must never see our writes after it.
        if len(changes) > 1 or (changes and self.known.has_bundle(root.name)):
            blob = encode_bundle(root.name, changes)
            await self.guard()
            await self.store.put(bundle_key(root.name), blob,
                                 ObjectMeta.of(blob, time.time_ns(), 0o600, version=self.version()))
            self.known.add_bundle(root.name)
        for c in changes:  # the bundle makes the batch atomic; order within it does not matter
            await self.guard()
            if c.data is None:
                await self.store.delete(c.key)
                self.known.deleted(c.key)
                self.totals.deleted()
            else:
                self.known.stored(c.key, await self.store.put(c.key, c.data, replace(c.written, version=self.version())))
                self.totals.uploaded(len(c.data))
        if self.known.has_bundle(root.name):
            await self.guard()
            await self.store.delete(bundle_key(root.name))
            self.known.discard_bundle(root.name)

    async def drop_stale_bundles(self, snapshot_roots: set[str], keep: set[str],
                                 pending_keys: Callable[[], set[str]]) -> None:
        """Delete the bundles that cut-short snapshot commits left for roots with nothing left to
        commit (no key in ``pending_keys()``: their disk already matches the per-file objects),
        except for roots in ``keep`` (whose disk is not the truth). A delete is a write: it waits
        for the guard (the claim)."""
        await self.guard()
        if snapshot_roots:
            # Listed again now that the claim's wait is over: a predecessor fenced in the middle of
            # a commit may have left its bundle after our start-up listing, and from now on none of
            # its writes can land. Left in place, a later restore would lay it over our files.
            try:
                async for info in self.store.list(BUNDLE_DIR + "/"):
                    name = info.key[len(BUNDLE_DIR) + 1 :]
                    if name in snapshot_roots:
                        self.known.add_bundle(name)
            except StoreError as e:
                log.warning("bundle_cleanup_failed", root="-", error=str(e))
        for name in sorted(self.known.bundles() - keep):
            async with self._lock(name):
                # decided under the lock: a commit of this root may have replaced the bundle, or
                # have changes to commit, since the loop began
                if not self.known.has_bundle(name) or any(k.split("/", 1)[0] == name for k in pending_keys()):
                    continue
                try:
                    await self.store.delete(bundle_key(name))
                    self.known.discard_bundle(name)
                except StoreError as e:
                    log.warning("bundle_cleanup_failed", root=name, error=str(e))
