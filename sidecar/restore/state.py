"""The state of one latest-state restore (:class:`Run`) that its sources share, and what it
returns (:class:`RestoreResult`) or raises (:class:`RestoreError`)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import anyio
import anyio.abc

from sidecar.listing import Listing
from sidecar.localfs import ByteBudget, root_failure
from sidecar.paths import Root
from sidecar.plan import ShapeConflicts
from sidecar.restore import plan
from sidecar.restore.place import BatchWriter, Placer
from sidecar.restore.plan import Disk, RootDecision, pending_held
from sidecar.restore.points import PointFeed
from sidecar.restore.progress import Progress
from sidecar.restorefs import mark_restoring
from sidecar.snapshot import Change
from sidecar.store.base import ObjectInfo, Store


class RestoreError(Exception):
    """Restore cannot bring the state back; the host must not start."""


#: Unverified files named one by one in the log (the rest are counted in ``restore_done``).
UNVERIFIED_SHOWN = 20

@dataclass
class RestoreResult:
    decisions: list[RootDecision] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    refused: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)  # corrupt objects left out (on_corrupt="skip")
    unverified: int = 0
    generated_names: set[str] = field(default_factory=set)
    #: merged roots' local files whose bytes differed from their stored version: replaced by it
    replaced: list[str] = field(default_factory=list)
    #: merged roots' local files that already held their stored bytes: left as they were
    in_place: int = 0
    #: files placed from restore points (the rest of those restored came from their own objects)
    from_points: int = 0
    #: roots that are this namespace's but do not exist yet: recorded before their first upload
    unrecorded: set[str] = field(default_factory=set)
    #: the generation of the namespace's state: the marker's, or the newest stored if later; a
    #: root's record must be no older for its disk to be held, and the roots recorded carry it
    generation: int = 0

    def restored_roots(self) -> set[str]:
        return {d.name for d in self.decisions if d.restore}


#: A queued file: its root, and what the listing says of it.
Item = tuple[Root, ObjectInfo]
#: A key's path below its root, one name a part.
Parts = list[str]


class Run:
    """One latest-state restore's state, shared by its sources (:mod:`.bundles`, :mod:`.objects`,
    the points of :mod:`.latest`): the store's listing and each candidate root's bundle queue files
    while ``concurrency`` workers download, verify and place them, so the first files land while
    the listing is still being fetched and parsed; the restore points place theirs meanwhile."""

    def __init__(self, store: Store, roots: list[Root], candidates: dict[str, Root], result: RestoreResult,
                 on_corrupt: str = "fail", max_file_size: int = 2**63, merging: frozenset[str] = frozenset(),
                 disk: dict[str, Disk] | None = None, mode: str = "auto") -> None:
        self.store = store
        self.disk, self.mode = disk or {}, mode
        #: roots the disk says are held: decided once the listing has ended (an older copy is merged)
        self.pending = pending_held(self.disk, mode)
        self.deferred: dict[str, dict[str, ObjectInfo]] = {}  # their listed files meanwhile
        self.older: list[str] = []  # those found older than the store: merged
        self.feeders: anyio.abc.TaskGroup | None = None  # for the bundles of those merged
        # candidates merged (a local file with the stored bytes is left in place), and the pending
        # roots, merged if older
        merging = merging | self.pending
        self.merging = merging
        self.max_file_size = max_file_size  # larger objects are refused (kept in the store)
        self.on_corrupt = on_corrupt  # "fail": a corrupt object fails the restore; "skip": quarantined
        self.by_name = {r.name: r for r in roots}
        self.candidates = candidates  # roots the disk lets us fill, if anything is stored
        self.result = result
        self.listing = self._new_listing()
        self.started: dict[str, Root] = {}  # roots with their restore marker down: files are coming
        self.queued: set[str] = set()  # keys handed to the workers (a retried listing skips them)
        #: each candidate's bundle by key, once fetched: what a cut-short snapshot commit left
        self.overlays: dict[str, dict[str, Change]] = {}
        self.overlay_known = {name: anyio.Event() for name in {*candidates, *self.pending}}
        self.bundles_read: set[str] = set()  # candidates whose bundle was there when read
        self.bundle_changes: dict[str, list[Change]] = {}  # their headers, as first read
        self.bundle_versions: dict[str, int] = {}  # and the bundle objects' versions
        self.listed = anyio.Event()  # the listing has ended: every key's listed version is known
        self.progress = Progress()
        self.placer = Placer(RestoreError, self._refused, lambda: self.progress.files)
        self.bodies = ByteBudget()  # the downloads' bytes in memory
        self.send, self.receive = anyio.create_memory_object_stream[Item](math.inf)
        self.points = PointFeed(store, merging, max_file_size)
        self.point_writes: BatchWriter | None = None  # a point's small files, while it is streamed

    def _queue(self, root: Root, info: ObjectInfo) -> None:
        self._start(root)
        self.queued.add(info.key)
        self.progress.expect(info.size)
        # every worker has ended (BrokenResourceError): the restore is cancelled or failed, and ends as such
        with contextlib.suppress(anyio.BrokenResourceError):
            self.send.send_nowait((root, info))

    def _start(self, root: Root) -> None:
        if root.name not in self.started:
            try:  # before the root's first file lands: a restore cut short from here on is known as such
                mark_restoring(root)
            except OSError as e:
                raise RestoreError(f"cannot write into {root.path}: {root_failure(root.path, e)}") from None
            self.started[root.name] = root

    def _refused(self, key: str, size: int) -> None:
        self.result.refused.append(key)
        self.progress.forget(size)

    def _bundle_wins(self, root_name: str, key: str, listed: ObjectInfo | None) -> bool:
        """Whether the root's bundle decides ``key`` rather than its ``listed`` object
        (:func:`~sidecar.restore.plan.bundle_wins`)."""
        return plan.bundle_wins(self.overlays.get(root_name), self.bundle_versions.get(root_name, 0), key, listed)

    def _superseded(self, root: Root, info: ObjectInfo) -> bool:
        """The root's bundle decides the file (its newer version is queued on its own, or it was
        deleted): then the file is not restored after all."""
        if not self._bundle_wins(root.name, info.key, info):
            return False
        self.progress.forget(info.size)
        return True

    def _new_listing(self) -> Listing:
        """A store whose names are not paths can hold a file and a directory of one name at once:
        its listing goes through the restore's rule for them (:class:`ShapeConflicts`)."""
        return Listing(shapes=ShapeConflicts(in_order=self.store.flat_namespace))
