"""The restore's one finish, latest state and ``restore --as-of`` alike: once every file is in
place, the roots filled are flushed, then recorded as this namespace's (their lineage), then lose
their restore marker, in that order (the record must not precede the flushed files), as
:class:`~sidecar.restore.plan.Finish` says."""

from __future__ import annotations

import anyio
import anyio.to_thread

from sidecar import log
from sidecar.paths import Root
from sidecar.restore.plan import Finish
from sidecar.restorefs import Lineage, clear_restoring, syncfs, write_lineage
from sidecar.store.base import Store


async def finish(plan: Finish, by_name: dict[str, Root], lineage: Lineage, unrecorded: set[str] | None = None) -> None:
    """Apply ``plan``: flush the filled roots, then record them, then remove their markers; remove
    the markers of the roots it clears; record the rest. A root that does not exist yet is added
    to ``unrecorded`` (recorded before its first upload)."""
    for name in plan.filled:
        root = by_name[name]
        await anyio.to_thread.run_sync(syncfs, root.path)
        # every file is in place and flushed: recorded as this namespace's, then the marker goes
        await record_lineage(root, lineage, unrecorded)
        clear_restoring(root)
    for name in plan.cleared:
        clear_restoring(by_name[name])  # nothing placed in it now: the disk is all there is
    for name in plan.recorded:
        await record_lineage(by_name[name], lineage, unrecorded)


def lineage_of(store: Store, namespace: str, generation: int = 0, version: int | None = None,
               marker: str | None = None) -> Lineage:
    """The lineage a root this sidecar fills or mirrors is recorded with: the store's description
    (secret-free, with its prefix), the namespace path, the generation of the state it holds, the
    highest version the store may hold of it and the namespace's lineage id (None: not recorded)."""
    return Lineage(store.description, namespace, generation, version, marker)


async def record_lineage(root: Root, lineage: Lineage, unrecorded: set[str] | None = None) -> bool | None:
    """Record that ``lineage`` filled or mirrors ``root`` (see :func:`~sidecar.restorefs.write_lineage`):
    True. None when the root does not exist yet (added to ``unrecorded``: recorded before its
    first upload); False when the record cannot be written (logged: the root is then not the
    truth on the next start, and is merged, which loses nothing)."""
    try:
        await anyio.to_thread.run_sync(write_lineage, root, lineage)
        return True
    except FileNotFoundError:
        if unrecorded is not None:
            unrecorded.add(root.name)
        return None
    except OSError as e:
        log.warning("lineage_unrecorded", root=root.path, error=e.strerror or type(e).__name__,
                    detail="the next start takes this root for a new disk and merges it from the store")
        return False
