"""The store's listing, filed: the files of the configured roots, their snapshot bundles, the
names no sync may place (set aside), and the highest version seen. Streamed by whoever lists (the
restore files each page as it arrives); :func:`list_store` is the whole listing at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from sidecar import log
from sidecar.localfs import unmirrorable_reason
from sidecar.marker import counted_version
from sidecar.paths import Root, UnsafeKey, split_key
from sidecar.plan import ShapeConflicts
from sidecar.points.format import POINT_DIR
from sidecar.snapshot import BUNDLE_DIR
from sidecar.store.base import ObjectInfo, Store


@dataclass
class Listing:
    """The store's content for the configured roots, with hostile names set aside."""

    objects: dict[str, ObjectInfo] = field(default_factory=dict)
    unsafe: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    bundles: set[str] = field(default_factory=set)  # roots with a snapshot bundle in the store
    #: the highest version of any object listed, whatever it is (a fence claim goes above it)
    max_version: int = 0
    #: the same of the configured roots' files, their bundles and the restore points only (not
    #: another root's data, nor a nested namespace's): the newest generation of this state stored
    own_max_version: int = 0
    #: stored, but replaced by a newer object of the other shape (file ``a`` vs ``a/...``): never
    #: restored; with ``shapes`` (the restore's rule) only
    stale: dict[str, ObjectInfo] = field(default_factory=dict)
    shapes: ShapeConflicts | None = None

    def add(self, info: ObjectInfo, by_name: dict[str, Root]) -> str | None:
        """File one listed object. The name of its root when it is a file of a configured root;
        None for a bundle, another root's data, or a hostile name (set aside in ``unsafe``)."""
        self.max_version = max(self.max_version, counted_version(info.version))
        if info.key.split("/", 1)[0] in by_name or info.key.startswith((BUNDLE_DIR + "/", POINT_DIR + "/")):
            self.own_max_version = max(self.own_max_version, counted_version(info.version))
        if info.key.startswith(BUNDLE_DIR + "/"):
            self.bundles.add(info.key[len(BUNDLE_DIR) + 1 :])
            return None
        first = info.key.split("/", 1)[0]
        if first and first not in by_name and first not in ("..", "."):
            return None  # another root's data, or not ours at all
        try:
            split_key(info.key, by_name)
        except UnsafeKey as e:
            self.unsafe.append((info.key, str(e)))
            return None
        if not info.key.isascii() and (why := unmirrorable_reason(info.key)):
            # a name no sync would store today (a directory store written by an older version)
            self.unsafe.append((log.no_surrogates(info.key), why))
            return None
        self.objects[info.key] = info
        for key in self.shapes.add(info) if self.shapes is not None else ():
            self.stale[key] = self.objects.pop(key)
        return first

    def settled(self, end: bool = False) -> list[ObjectInfo]:
        """With ``shapes``: the objects that may be restored, as :meth:`ShapeConflicts.settled`."""
        return self.shapes.settled(end) if self.shapes is not None else []


async def list_store(store: Store, roots: list[Root]) -> Listing:
    by_name = {r.name: r for r in roots}
    out = Listing()
    async for info in store.list():
        out.add(info, by_name)
    return out


async def list_names(store: Store, prefix: str = "") -> AsyncIterator[str]:
    """The keys ``store.list(prefix)`` gives, names only: through the store's own names-only
    listing where it has one (Azure: no properties fetched or parsed), else its full listing."""
    names = getattr(store, "list_names", None)
    if names is not None:
        async for key in names(prefix):
            yield key
        return
    async for info in store.list(prefix):
        yield info.key
