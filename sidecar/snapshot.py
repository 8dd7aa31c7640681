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
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sidecar.store.base import OWN_NAMESPACE, NotFound, ObjectMeta, Store

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
