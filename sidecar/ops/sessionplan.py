"""The pure rules of ``sessions`` and ``prune``: the namespaces of one streamed listing, the owner
of each, and which of them may be pruned. No I/O (docs/NAMESPACES.md, "Pruning").

**Namespaces from a listing.** Keys sharing a prefix are contiguous in list order (Azure lists
by name; the directory store walks depth first), so :class:`Grouper` keeps one running total per
directory on the current key's path and closes a directory when the listing leaves it: memory
is bounded by the depth of a key, never by the size of the store. A directory that holds objects
of its own below ``.sidecar/`` (the owner marker ``<ns>/.sidecar/owner``, snapshot bundles,
restore points) is a namespace; any other directory's totals go to the directory above it. The
top of the store (``''``) is a namespace when it has a marker or holds any object outside every
namespace (files written without namespaces, or below a namespace whose ``.sidecar/`` objects
were all removed by hand). Keys with a ``.sidecar-meta`` segment are the directory store's
records of a nested namespace, not objects, and are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.marker import (
    MAX_STAMP,
    PRUNE_DELETING,
    PRUNE_OWNER,
    STORED_VERSION,
    UNREADABLE,
    is_released,
    number,
    prune_phase,
)
from sidecar.store.base import OWN_NAMESPACE, ObjectInfo

#: The directory store's records directory (``store.dirfs.META_DIR``): never an object.
RECORDS_DIR = ".sidecar-meta"

#: Owners: a live sidecar, released on a clean exit, gone without releasing, no marker at all, a
#: prune under way (or one that died in it), a marker that cannot be read.
LIVE, RELEASED, STALE, NONE, PRUNING, UNKNOWN = "live", "released", "stale", "none", "pruning", "unknown"
#: Owners whose namespace may be pruned (once its last write is old enough).
ENDED = frozenset({RELEASED, STALE, NONE})


@dataclass
class Group:
    """One namespace as the listing showed it; ``namespace`` is relative to the store's prefix
    (``''``: the top)."""

    namespace: str
    objects: int = 0  # every object, the sidecar's own included
    files: int = 0  # mirrored files: objects outside .sidecar/
    bytes: int = 0  # of every object
    last_write: float | None = None  # the newest ``modified`` (the store's clock), the marker's included
    points: int = 0  # objects under .sidecar/points/
    marker: ObjectInfo | None = None  # the owner marker as listed
    own: bool = False  # holds objects below .sidecar/

    def merge(self, other: "Group") -> None:
        """Add a directory's totals that is not a namespace of its own."""
        self.objects += other.objects
        self.files += other.files
        self.bytes += other.bytes
        self.points += other.points
        if other.last_write is not None and (self.last_write is None or other.last_write > self.last_write):
            self.last_write = other.last_write


@dataclass
class Grouper:
    """Feed every listed object in list order (:meth:`add`); each call returns the namespaces the
    listing has just left, :meth:`finish` the rest (children before their parents)."""

    _stack: list[tuple[list[str], Group]] = field(default_factory=lambda: [([], Group(""))])

    def add(self, info: ObjectInfo) -> list[Group]:
        parts = info.key.split("/")
        if RECORDS_DIR in parts[:-1]:
            return []
        rest: list[str] | None = None
        if OWN_NAMESPACE in parts[:-1]:
            i = parts.index(OWN_NAMESPACE)
            where, rest = parts[:i], parts[i + 1:]
        else:
            where = parts[:-1]
        closed = self._enter(where)
        g = self._stack[-1][1]
        g.objects += 1
        g.bytes += max(info.size, 0)
        if info.modified is not None and (g.last_write is None or info.modified > g.last_write):
            g.last_write = info.modified
        if rest is None:
            g.files += 1
        else:
            g.own = True
            if rest == ["owner"]:
                g.marker = info
            elif rest[0] == "points":
                g.points += 1
        return closed

    def finish(self) -> list[Group]:
        """The namespaces still open, the top last (listed when it has a marker or any object)."""
        closed = self._enter([])
        _, top = self._stack[0]
        if top.own or top.objects:
            closed.append(top)
        self._stack = [([], Group(""))]
        return closed

    def _enter(self, where: list[str]) -> list[Group]:
        closed: list[Group] = []
        while len(self._stack) > 1:
            path, g = self._stack[-1]
            if where[:len(path)] == path:
                break
            self._stack.pop()
            if g.own:
                closed.append(g)
            else:
                self._stack[-1][1].merge(g)
        depth = len(self._stack[-1][0])
        for i in range(depth, len(where)):
            self._stack.append((where[:i + 1], Group("/".join(where[:i + 1]))))
        return closed


def owner(marker: dict | None, modified: float | None, now: float, live_within: float) -> str:
    """Who owns a namespace, told from its owner marker's fields (``marker``: as
    :func:`sidecar.marker.read_marker` gives them; None or {}: no marker), its ``modified`` and the
    store's current time ``now`` (both the store's clock: no two machines' clocks compared).
    ``released``: heartbeat 0. ``live``: rewritten within ``live_within`` seconds, or within twice
    the heartbeat interval the marker records, whichever is longer; always when it records 0
    (a sidecar that never rewrites its marker) or its time is not known. Else ``stale``."""
    if not marker:
        return NONE
    if marker.get(UNREADABLE):
        return UNKNOWN
    if prune_phase(marker):
        return PRUNING
    if is_released(marker):
        return RELEASED
    interval = number(marker.get("interval"), float) if "interval" in marker else None
    if interval == 0 or modified is None:
        return LIVE
    if interval is not None and interval >= MAX_STAMP:
        return LIVE
    threshold = max(live_within, 2 * interval if interval else 0.0)
    return LIVE if now - modified < threshold else STALE


def prunable(who: str, last_write: float | None, marker: dict | None, marker_modified: float | None, now: float,
             older_than: float, live_within: float, *, versions: bool = True) -> bool:
    """Whether a namespace may be pruned: its owner ended (released, stale, no marker) and its last
    write is at least ``older_than`` seconds old (0: any age); or a prune of it died, which is
    finished: at once when its marker proves a prune had it deleting (:func:`prune_owned`), else
    once its prune marker is unchanged for ``live_within`` (a ``pending`` one starts over). A
    stale namespace is also written nothing for ``live_within`` (a sidecar that writes is not
    gone, whatever its marker says). ``versions`` False: the marker's stored version is not
    known (a listing's read through another namespace's store), so only its fields count."""
    if who == PRUNING:
        if prune_owned(marker, versions=versions):
            return True
        return marker_modified is not None and now - marker_modified >= live_within
    if who not in ENDED:
        return False
    if who == STALE and (last_write is None or now - last_write < live_within):
        return False
    if older_than <= 0:
        return True
    return last_write is not None and now - last_write >= older_than


def deleting(marker: dict | None) -> bool:
    """Whether a marker is a prune's in its deleting phase."""
    return bool(marker) and prune_phase(marker or {}) == PRUNE_DELETING


def prune_owned(marker: dict | None, *, versions: bool = True) -> bool:
    """Whether ``marker`` proves a prune had the namespace deleting: the phase ``deleting``, an
    owner ``prune:<id>``, and (``versions``) stored at the very stamp it records, as prune writes
    it (:func:`sidecar.marker.read_marker`'s stored version). A prune writes ``deleting`` only
    by a compare-and-swap from its own ``pending`` marker after the grace: no sidecar claimed the
    namespace meanwhile, and from then on none restores or claims it (it waits, or is fenced).
    So no live session can be behind such a marker, and the next prune may finish what a dead
    one left at once: what it deletes is what that prune was deleting."""
    if not marker or not deleting(marker) or not str(marker.get("owner", "")).startswith(PRUNE_OWNER):
        return False
    stamp = number(marker.get("generation"), int)
    return not versions or (stamp > 0 and marker.get(STORED_VERSION) == stamp)
