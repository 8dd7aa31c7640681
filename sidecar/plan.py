"""Pure decisions: what a reconcile must upload or delete, what a restore must fetch, what status says."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from sidecar.localfs import Gaps, LocalStat
from sidecar.store.base import ObjectInfo


@dataclass(frozen=True)
class Protected:
    """What a reconcile never deletes from the store, because the disk does not say the host
    deleted it: every stored key of ``roots`` (a root with no files that the restore did not fill,
    a root a restore was cut short in, a disk this namespace is not known to hold), the ``keys``
    refused or quarantined at restore (never placed on disk), and what ``gaps`` covers (what the
    scan could not see: an unreadable directory)."""

    roots: frozenset[str] = frozenset()
    keys: frozenset[str] = frozenset()
    gaps: Gaps | None = None

    def covers(self, key: str) -> bool:
        """Whether the stored ``key`` must be kept whatever the disk shows."""
        return (key.split("/", 1)[0] in self.roots or key in self.keys
                or (self.gaps is not None and self.gaps.covers(key)))


@dataclass
class ReconcilePlan:
    upload: list[str] = field(default_factory=list)  # local files the store lacks or holds stale
    delete: list[str] = field(default_factory=list)  # stored objects whose file is gone locally
    in_sync: int = 0


def plan_reconcile(
    local: dict[str, LocalStat],
    remote: dict[str, ObjectInfo],
    protected: Protected = Protected(),
) -> ReconcilePlan:
    """Make the store match the disk. A file counts as in sync when the store recorded the same
    size and mtime (the content hash is checked when the file is read for upload, so a touched but
    unchanged file costs a read, not a write). What ``protected`` covers is never deleted."""
    plan = ReconcilePlan()
    for key in sorted(local):
        st = local[key]
        info = remote.get(key)
        if info is None or info.sha256 is None or info.size != st.size or info.mtime_ns != st.mtime_ns or info.mode != st.mode:
            plan.upload.append(key)
        else:
            plan.in_sync += 1
    for key in sorted(remote):
        if key not in local and not protected.covers(key):
            plan.delete.append(key)
    return plan


def plan_reconcile_queue(
    local: dict[str, LocalStat],
    known: dict[str, ObjectInfo],
    *,
    known_before: set[str] | None,
    busy: set[str],
    still_skipped: Callable[[str, LocalStat], bool] = lambda key, st: False,
    protected: Protected = Protected(),
) -> ReconcilePlan:
    """What a reconcile queues: :func:`plan_reconcile` of the scan ``local`` against ``known`` (what
    the store is known to hold of the scanned roots), less what a race with live writes would make
    wrong. The candidates only: the caller still checks each delete against the disk.

    * ``busy`` keys (an operation pending or running) are left to that operation, which acts on the
      disk as it finds it then.
    * A file skipped and unchanged since (``still_skipped``) is not queued again.
    * Only keys in ``known_before``, what the store was known to hold before the scan began, are
      deleted: a key stored while the scan ran may be missing from it (its directory was passed
      already). None when ``known`` itself predates the scan (a full listing, made before it).
    * Never deleted: what ``protected`` covers."""
    plan = plan_reconcile(local, known, protected)
    return ReconcilePlan(
        upload=[k for k in plan.upload if k not in busy and not still_skipped(k, local[k])],
        delete=[k for k in plan.delete if k not in busy and (known_before is None or k in known_before)],
        in_sync=plan.in_sync,
    )


@dataclass(frozen=True)
class RootKeep:
    """What one reconcile learns of a root for :class:`Protected` and the lineage record:
    ``empty`` True when its stored files are kept because it is empty and was not restored (False:
    it has files, so no longer; None: unchanged), ``unproven`` when they are kept because the disk
    is not known to be this namespace's, ``incomplete`` when they are kept because a restore into
    it was cut short, and ``due`` when its lineage must be recorded before its first upload."""

    empty: bool | None = None
    unproven: bool = False
    incomplete: bool = False
    due: bool = False


def plan_root_keep(*, initial: bool, has_files: bool, restored: bool, due: bool, unproven: bool,
                   ours: bool, recorded: bool, cut_short: bool, stored: bool) -> RootKeep:
    """The rule for one scanned root. ``initial``: the first reconcile of this start, which alone
    classifies a root (later ones only see files appear); ``restored``: this start's restore filled
    it; ``due`` / ``unproven``: what earlier reconciles said; ``ours``: its lineage record names this
    store and namespace; ``recorded``: it carries a record at all; ``cut_short``: its restore marker
    is there; ``stored``: the store holds files of it, or may (not listed).

    * A root with no files that the restore did not fill keeps its stored files (``empty``) until
      it has files again: an empty disk never empties the store. A root empty at start of which
      the store holds nothing is new, not kept: it has nothing stored to keep, and what the host
      writes into it is in the next point, not left out of points until a reconcile sees it.
    * At the first reconcile, a root neither due nor carrying this namespace's record is
      ``unproven``: the disk is not the truth. Otherwise a root that is not unproven and carries
      no record (the host removed the root, and the record with it) is ``due`` again.
    * At the first reconcile, a root whose restore was cut short is ``incomplete``."""
    empty = False if has_files else (True if initial and not restored and stored else None)
    if initial and not due and not ours:
        return RootKeep(empty, unproven=True, incomplete=cut_short)
    return RootKeep(empty, due=not unproven and not recorded, incomplete=initial and cut_short)


@dataclass(frozen=True)
class RootPresence:
    """What one scan says of a root as a whole (:func:`plan_root_presence`). ``intact``: the scan
    shows the directory being mirrored, so what it lacks the host deleted; otherwise every stored
    file of the root is kept for this reconcile. ``gone``: why the root counts as gone (warned,
    unready), None when it does not. ``returned``: it is back (or another directory stands in its
    place) with files; the stored files it lacks were not deleted by the host one by one."""

    intact: bool = True
    gone: str | None = None
    returned: bool = False


#: why a root counts as gone, by what stands at its path
GONE_MISSING = "it no longer exists, or is not a directory"
GONE_EMPTY = "an empty directory stands in its place"


def plan_root_presence(*, present: bool, replaced: bool, was_gone: bool, stored: bool, seen: bool,
                       has_files: bool) -> RootPresence:
    """The rule for a root as a whole: what cannot be read is never taken for deleted.

    ``present``: the root is a directory, the same one before and after the scan; ``replaced``: it
    is not the directory the last scan saw (another identity, or it was reported removed itself and
    carries no lineage record now); ``was_gone``: the last scan counted it gone; ``stored``: the
    store holds files of it; ``seen``: it existed earlier in this run (or the restore filled it).

    * A root that is not there (removed, a mount gone, a file or a dangling link in its place) is
      not intact: nothing stored is deleted for it. It counts as gone when the store holds its
      files and it existed in this run (a root the host has not made yet is only not there yet).
    * A root back after it was gone, or replaced, with files: intact, ``returned``.
    * Back, or replaced, but without files while the store holds some: still gone (an empty
      stand-in, such as the mount point under a volume that went away, is not taken for the root:
      at start, an empty root is filled from the store, never the other way round).
    """
    if not present:
        return RootPresence(intact=False, gone=GONE_MISSING if stored and (seen or was_gone) else None)
    if was_gone or replaced:
        if not has_files and stored:
            return RootPresence(intact=False, gone=GONE_EMPTY)
        return RootPresence(returned=True)
    return RootPresence()


@dataclass
class Status:
    in_sync: list[str] = field(default_factory=list)
    pending_upload: list[str] = field(default_factory=list)  # on disk, not (or stale) in the store
    missing_locally: list[str] = field(default_factory=list)  # in the store, not on disk
    unreadable: list[str] = field(default_factory=list)  # directories the sidecar cannot read
    unstorable: list[str] = field(default_factory=list)  # files a store cannot hold (name too long)

    @property
    def ok(self) -> bool:
        return not (self.pending_upload or self.missing_locally or self.unreadable or self.unstorable)


def plan_status(local: dict[str, LocalStat], remote: dict[str, ObjectInfo], gaps: Gaps | None = None) -> Status:
    plan = plan_reconcile(local, remote, Protected(gaps=gaps))
    s = Status(pending_upload=plan.upload, missing_locally=plan.delete,
               unreadable=sorted(gaps.unreadable) if gaps else [], unstorable=sorted(gaps.unstorable) if gaps else [])
    pending = set(plan.upload)
    s.in_sync = sorted(k for k in local if k not in pending)
    return s


def newer_shape(a: ObjectInfo, b: ObjectInfo) -> bool:
    """Whether ``a`` was stored after ``b``, by the sidecar's version (never a clock). Equal
    versions (0 for both: an older release's, another tool's) decide nothing."""
    return a.version > b.version


class ShapeConflicts:
    """The restore's rule for a key stored both as a file and as a directory (``r/a`` and
    ``r/a/x``): a swap the sidecar mirrors deletes the replaced shape only after the new one is
    stored, so a crash in between leaves both. Of every such pair (a file and an object below its
    path) the older (:func:`newer_shape`) is stale: it was replaced before the other was written.
    Stale objects are never restored (they stay stored until a reconcile deletes them). A pair of
    equal versions is left as it is: the restore places the first listed and keeps the other.

    Fed the objects of a listing in name order (:meth:`add`; a store with a flat namespace,
    Azure's), it holds each back until no object below its path can still come (a name at or past
    ``key + "0"``: every ``key/...`` sorts before it) and then releases it (:meth:`settled`) unless
    it turned out stale. A listing found not to be in name order is passed through as it comes
    from its first name out of order. Pure: no I/O."""

    def __init__(self, in_order: bool = True) -> None:
        """``in_order=False``: a store that cannot hold both shapes (a directory store, whose walk
        comes in no order): every object is released as it comes."""
        self._open: list[ObjectInfo] = []  # held, in name order: later names may still lie below them
        self._stale: set[str] = set()
        self._ready: list[ObjectInfo] = []
        self._last: str | None = None
        self._in_order = in_order

    def add(self, info: ObjectInfo) -> list[str]:
        """File the next listed object; the keys it shows to be stale (itself, or held ones)."""
        key = info.key
        if self._in_order and self._last is not None and key <= self._last:
            self._in_order = False  # not a sorted listing: no more holding back
            self._ready += [o for o in self._open if o.key not in self._stale]
            self._open.clear()
        self._last = key
        if not self._in_order:
            self._ready.append(info)
            return []
        while self._open and key >= self._open[-1].key + "0":  # no more names below the top
            done = self._open.pop()
            if done.key in self._stale:
                self._stale.discard(done.key)
            else:
                self._ready.append(done)
        stale: list[str] = []
        lost = False
        for above in self._open:  # the held objects include every file on this key's path
            if key.startswith(above.key + "/"):
                if newer_shape(above, info):
                    lost = True  # the file replaced it: it was there before the file
                elif newer_shape(info, above) and above.key not in self._stale:
                    stale.append(above.key)  # the directory replaced the file
                    self._stale.add(above.key)
        if lost:
            stale.append(key)
            self._stale.add(key)
        self._open.append(info)  # held even when stale: objects further below compare with it too
        return stale

    def settled(self, end: bool = False) -> list[ObjectInfo]:
        """The objects released since the last call (with ``end``: the listing is over, all of them)."""
        if end:
            self._ready += [o for o in self._open if o.key not in self._stale]
            self._open.clear()
        ready, self._ready = self._ready, []
        return ready
