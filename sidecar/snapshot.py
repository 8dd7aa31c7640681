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

from sidecar.store.base import NotFound, ObjectMeta, Store

BUNDLE_DIR = ".sidecar/bundles"


def bundle_key(root_name: str) -> str:
    return f"{BUNDLE_DIR}/{root_name}"


@dataclass(frozen=True)
class Change:
    key: str
    data: bytes | None  # None: deleted
    meta: ObjectMeta | None


def encode_bundle(root_name: str, changes: list[Change]) -> bytes:
    header = {
        "version": 1,
        "root": root_name,
        "entries": [
            {"key": c.key, "deleted": True} if c.data is None else
            {"key": c.key, "size": c.meta.size, "sha256": c.meta.sha256, "mtime_ns": c.meta.mtime_ns,
             "mode": c.meta.mode}
            for c in changes
        ],
    }
    return json.dumps(header, separators=(",", ":")).encode() + b"\n" + b"".join(
        c.data for c in changes if c.data is not None
    )


class BundleError(ValueError):
    pass


def decode_bundle(blob: bytes) -> tuple[str, list[Change]]:
    try:
        head, _, body = blob.partition(b"\n")
        header = json.loads(head)
        if header.get("version") != 1:
            raise BundleError(f"unknown bundle version {header.get('version')!r}")
        changes, offset = [], 0
        for e in header["entries"]:
            if e.get("deleted"):
                changes.append(Change(e["key"], None, None))
                continue
            data = body[offset : offset + e["size"]]
            offset += e["size"]
            meta = ObjectMeta(e["size"], e["sha256"], e["mtime_ns"], e["mode"])
            if ObjectMeta.of(data, meta.mtime_ns, meta.mode).sha256 != meta.sha256:
                raise BundleError(f"bundle entry {e['key']!r} does not match its sha256")
            changes.append(Change(e["key"], data, meta))
        return header["root"], changes
    except (ValueError, KeyError, TypeError) as e:
        raise BundleError(f"unreadable bundle: {e}") from None


async def fetch_bundle(store: Store, root_name: str) -> list[Change] | None:
    """The root's outstanding bundle, or None."""
    try:
        blob, _ = await store.get(bundle_key(root_name))
    except NotFound:
        return None
    _, changes = decode_bundle(blob)
    return changes
