"""The restore's decisions, apart from its I/O (the rest of :mod:`sidecar.restore` applies them,
calling them through this module): which roots may be filled, what each stored file becomes and
where its bytes come from (its object, its root's bundle, a restore point), which roots are
restored once the listing has ended (the rule per root: :func:`decide_restore`), and what is
recorded on disk afterwards. Pure.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable, Mapping, Protocol, Sequence, TypeVar
from urllib.parse import urlsplit

from sidecar.paths import LINEAGE_FILE
from sidecar.restorefs import Lineage
from sidecar.store.base import VERSION_COUNTER_BITS, ObjectInfo, ObjectMeta


@dataclass(frozen=True)
class Disk:
    """What the disk says of one root before the restore: whether it holds regular files, whether
    an earlier restore into it was cut short, and whether it carries this store and namespace's
    lineage record (``held``)."""

    has_files: bool
    cut_short: bool
    held: bool
    #: the generation the held root's record carries (None: not held)
    generation: int | None = None
    #: held by its record, but the store holds a later generation of the namespace (a copy of the
    #: disk taken earlier): merged (:func:`older_copies`)
    older: bool = False
    #: the highest version the held root's record says the store may hold of it (None: none recorded)
    version: int | None = None


@dataclass(frozen=True)
class Candidates:
    """The roots the disk lets the restore fill, if anything is stored for them (known from the
    disk alone, so downloads begin with the listing's first page), and those of them merged (a
    local file with the stored bytes is left in place)."""

    roots: frozenset[str]
    merging: frozenset[str]


@dataclass
class RootDecision:
    name: str
    restore: bool
    reason: str
    #: restored by merging: the stored files are brought in beside the disk's own (see decide_restore)
    merge: bool = False
    #: once the restore has ended, the root is this namespace's disk: its lineage record says so
    owned: bool = False


def decide_restore(root_name: str, local_has_files: bool, stored: int, mode: str,
                   cut_short: bool = False, held: bool = False, older: bool = False) -> RootDecision:
    """The restore rule. ``mode`` is ``auto``, ``force`` or ``skip``. ``held``: the root carries
    the lineage record of this store and namespace (they filled or mirrored it: the same disk).

    * ``skip``: never restore.
    * ``force``: restore every stored file, replacing local copies.
    * ``auto``: a root with no regular files (fresh compute; empty placeholder directories count as
      empty) is filled from the store. A root that holds files is the truth only when ``held``: it
      is left alone, and ``sync`` then makes the store match it, so pruned checkpoints never come
      back. A root that holds files but not this namespace's record (a fresh compute's image, a
      disk from a release without records; another namespace's is refused before) is merged:
      every stored file is restored (a local file whose bytes differ is replaced), and the local
      files the store lacks stay, to be mirrored.
    * ``older`` (not ``held``: its record is this namespace's, but the store holds a later
      generation, so the disk is an older copy): merged like a disk without a record, so that it
      never rolls the store back.
    * ``cut_short`` (an earlier restore into the root never finished): the files there are a
      fragment of the stored state, not the truth, so ``auto`` restores the root again. (With
      ``skip`` the sync daemon keeps the root's stored files from being deleted instead.)

    ``owned`` in the decision: once the restore ends the disk holds what the store holds of the
    root (or the store holds nothing of it), so the root is this namespace's from then on.
    """
    if mode == "skip":
        return RootDecision(root_name, False, "restore disabled", owned=not cut_short and (held or stored == 0))
    if stored == 0:
        return RootDecision(root_name, False, "nothing stored", owned=True)
    if mode == "force":
        return RootDecision(root_name, True, "forced", owned=True)
    if cut_short:
        return RootDecision(root_name, True, "an earlier restore into this root was cut short: restoring it again",
                            owned=True)
    if not local_has_files:
        return RootDecision(root_name, True, "root is empty: filling it from the store", owned=True)
    if held:
        return RootDecision(root_name, False, "root holds files this namespace mirrored: the disk is the truth",
                            owned=True)
    if older:
        return RootDecision(root_name, True, "root holds files of an older generation of this namespace than the "
                                             "store holds (a copy of its disk taken earlier): merging from the store",
                            merge=True, owned=True)
    return RootDecision(root_name, True, "root holds files but no record that this namespace filled it: "
                                         "merging from the store", merge=True, owned=True)


def may_restore(local_has_files: bool, mode: str, cut_short: bool = False, held: bool = False) -> bool:
    """Whether :func:`decide_restore` restores the root if anything is stored for it: what the
    disk alone says, before the listing has ended."""
    return decide_restore("", local_has_files, 1, mode, cut_short, held).restore


def holds(record: Lineage | None, lineage: Lineage, marker_generation: int) -> bool:
    """Whether a root whose lineage record is ``record`` is held (the truth, see
    :func:`decide_restore`) by a sidecar of ``lineage``, when the namespace's owner
    marker was at ``marker_generation`` before the restore: the same store and namespace, and a
    generation no older than the marker's, under the lineage id the marker carries (when the
    record has one and there is a marker: one without an id, ``""``, is not the record's). A disk
    that holds an older state of this namespace (a copy taken earlier, a node's disk another
    compute of the session moved on from) is not, nor is one whose record carries no generation,
    nor one filled against another store at the same place (another lineage id)."""
    return (record is not None and same_namespace(record, lineage)
            and record.generation is not None and record.generation >= marker_generation
            and (record.marker is None or lineage.marker is None or record.marker == lineage.marker))


def stored_generation(max_version: int) -> int:
    """The generation of the namespace a stored version was written in (``fence.next_version``:
    the writer's generation above its write counter)."""
    return max_version >> VERSION_COUNTER_BITS


def pending_held(disk: Mapping[str, Disk], mode: str) -> frozenset[str]:
    """The roots the disk alone says are held (the truth, nothing downloaded): their decision waits
    for the listing's end, which may show a later generation stored (:func:`older_copies`)."""
    return frozenset() if mode == "force" else frozenset(
        name for name, d in disk.items() if d.held and d.has_files and not d.cut_short)


def older_copies(disk: Mapping[str, Disk], pending: Iterable[str], own_max_version: int) -> list[str]:
    """Of the ``pending`` roots, those older than what the store holds of this namespace's roots
    (``own_max_version``: their files, bundles and points): a record of an older generation (a
    copy of the disk taken before a later compute of the namespace wrote), or one whose version is
    below the newest stored (a copy taken before this disk's own sidecar wrote more: every write
    raises the record's version before it is sent). Not the truth: merged, so that it never rolls
    the store back."""
    newest = stored_generation(own_max_version)
    return [name for name in pending if (disk[name].generation or 0) < newest
            or _below(disk[name].version, own_max_version)]


def _below(version: int | None, stored: int) -> bool:
    """Whether a record's ``version`` is below the ``stored`` one (a record without: never)."""
    return version is not None and version < stored


def store_identity(description: str) -> str:
    """The store a description names, apart from the way it is reached: an Azure container (and
    prefix) by its account and path, whatever the endpoint in front of it (a proxy, a private
    endpoint, an emulator's port); any other store as written. A lineage record names the store
    by its description, and the same store reached another way is the same store."""
    parts = urlsplit(description)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return description
    host, path = parts.hostname, parts.path.strip("/")
    if host == "localhost" or "." not in host or host.replace(".", "").isdigit() or ":" in host:
        account, _, rest = path.partition("/")  # path-style (an emulator, an IP): the account leads the path
    else:
        account, rest = host.split(".", 1)[0], path  # <account>.blob.<suffix>/<container>...
    return f"azure://{account}/{rest}"


def same_namespace(record: Lineage, lineage: Lineage) -> bool:
    """Whether ``record`` names ``lineage``'s store (:func:`store_identity`) and namespace."""
    return record.namespace == lineage.namespace and store_identity(record.store) == store_identity(lineage.store)


def foreign(record: Lineage | None, lineage: Lineage) -> bool:
    """Whether a root's ``record`` names another store or namespace than ``lineage``'s."""
    return record is not None and not same_namespace(record, lineage)


def foreign_refusal(path: str, record: Lineage, lineage: Lineage, printable: Callable[[str], str]) -> str:
    """Why a sidecar of ``lineage`` refuses a root at ``path`` holding files that ``record``'s
    store and namespace put there (another session's volume): one line naming both and what to do.
    ``printable`` escapes what the record says (read from a disk: untrusted)."""
    theirs = f"'{printable(record.namespace) or '(top of the store)'}' of {printable(record.store)}"
    ours = f"'{lineage.namespace or '(top of the store)'}' of {lineage.store}"
    return (f"the root {printable(path)} holds files of the store namespace {theirs}, and this sidecar mirrors "
            f"{ours}: another namespace's files never enter this one, so nothing was restored, uploaded or "
            f"deleted. Attach this namespace's own volume, or move the root aside (mv {printable(path)} "
            f"{printable(path)}.foreign) and start again to restore this namespace's state; to take these files "
            f"into this namespace on purpose, remove {printable(path)}/{LINEAGE_FILE} first")


def unreadable_refusal(path: str, why: str, lineage: Lineage, printable: Callable[[str], str]) -> str:
    """Why a sidecar of ``lineage`` refuses a root at ``path`` holding files whose lineage record
    cannot be read (``why``): it may name another namespace. One line and what to do."""
    ours = f"'{lineage.namespace or '(top of the store)'}' of {lineage.store}"
    record = f"{printable(path)}/{LINEAGE_FILE}"
    return (f"the root {printable(path)} holds files and its lineage record {record} cannot be read "
            f"({printable(why)}): whose namespace these files are cannot be told, and this sidecar mirrors {ours}, "
            f"so nothing was restored, uploaded or deleted. Give this sidecar read access to the record; or move "
            f"the root aside (mv {printable(path)} {printable(path)}.unknown) and start again to restore this "
            f"namespace's state; to take these files into this namespace on purpose, remove {record} first")


def plan_candidates(disk: Mapping[str, Disk], mode: str) -> Candidates:
    """The candidates: the roots :func:`decide_restore` restores if one file is stored."""
    roots, merging = set(), set()
    for name, d in disk.items():
        first = decide_restore(name, d.has_files, 1, mode, d.cut_short, d.held)
        if first.restore:
            roots.add(name)
            if first.merge:
                merging.add(name)
    return Candidates(frozenset(roots), frozenset(merging))


def stored_counts(names: Iterable[str], listed: Iterable[str], bundled: Mapping[str, Mapping[str, bool]]) -> dict[str, int]:
    """Files stored per root once the listing has ended: the ``listed`` keys, with each root's
    bundle applied (``bundled``: root -> key -> whether the bundle deletes it)."""
    count = dict.fromkeys(names, 0)
    listed = set(listed)
    for key in listed:
        count[key.split("/", 1)[0]] += 1
    for name, changes in bundled.items():
        for key, deleted in changes.items():
            if deleted and key in listed:
                count[name] -= 1
            elif not deleted and key not in listed:
                count[name] += 1
    return count


def decide_roots(disk: Mapping[str, Disk], stored: Mapping[str, int], mode: str) -> list[RootDecision]:
    """The decision for every root (in ``disk``'s order), once what is stored is known."""
    return [decide_restore(name, d.has_files, stored[name], mode, d.cut_short, d.held, d.older)
            for name, d in disk.items()]


def commits_begun_meanwhile(candidates: Iterable[str], listed_bundles: set[str], read_bundles: set[str]) -> list[str]:
    """Candidates whose bundle was read as absent but is listed: a snapshot commit of another
    sidecar (still draining, see fence.py) began while the root was being restored, so the restore
    must be redone."""
    return [name for name in candidates if name in listed_bundles and name not in read_bundles]


class FileAction(Enum):
    """What the restore does with one stored file of a candidate root."""

    REFUSE_TOO_LARGE = "refuse_too_large"  # larger than SIDECAR_MAX_FILE_SIZE: kept in the store only
    IN_PLACE = "in_place"  # a merged root's file already holds the stored bytes: left as it is
    WRITE = "write"  # downloaded, verified and placed
    REPLACE = "replace"  # a merged root's file differs: replaced by the stored version


def file_action(size: int, max_file_size: int, local_same: bool | None = None) -> FileAction:
    """``local_same``, for a merged root: whether the disk's file holds the stored bytes (True),
    differs (False), or is not there (None); None for a root that is filled."""
    if size > max_file_size:
        return FileAction.REFUSE_TOO_LARGE
    if local_same is None:
        return FileAction.WRITE
    return FileAction.IN_PLACE if local_same else FileAction.REPLACE


def bundle_wins(bundle: Mapping[str, object] | None, bundle_version: int, key: str,
                listed: ObjectInfo | None) -> bool:
    """Whether the root's bundle (its changes by key, None while not read; ``bundle_version``: the
    bundle object's version) decides ``key`` rather than its ``listed`` object (None: not listed):
    it names the key, and its version is not below the listed object's (a later writer's object
    wins; a commit's own puts come after its bundle, with its bytes). Equal versions are possible
    only when neither carries one (both written by a release without versions, 0): the bundle wins
    then, as the snapshot protocol of that release needs. Its own object is then not restored."""
    if bundle is None or key not in bundle:
        return False
    return listed is None or listed.version <= bundle_version


def names_generated(key: str, streamed: bool) -> bool:
    """Whether a restored file is searched for a generated workflow name: a checkpoint held in memory."""
    return not streamed and (key.startswith(".checkpoints/") or key.endswith(".json"))


GENERATED_NAME = re.compile(rb"WorkflowBuilder-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def generated_name(data: bytes) -> str | None:
    """The first workflow name ``WorkflowBuilder`` generated (``WorkflowBuilder-<uuid4>``) in a
    checkpoint, if any. ``bytes.find`` skips to candidates (a regex search over every byte of a
    100 KiB checkpoint cost 50 µs, a tenth of a restored file's CPU)."""
    start = data.find(b"WorkflowBuilder-")
    while start >= 0:
        m = GENERATED_NAME.match(data, start)
        if m:
            return m.group(0).decode()
        start = data.find(b"WorkflowBuilder-", start + 1)
    return None


@dataclass(frozen=True)
class Finish:
    """What the restore records on disk once every file is in place, per root in the roots' order:

    * ``filled``: roots files were placed in: flushed, recorded as this namespace's, then their
      restore marker removed (in that order: the record must not precede the flushed files);
    * ``cleared``: roots a restore was cut short in and that got nothing now (nothing is stored any
      more): the disk is all there is, so their marker goes;
    * ``recorded``: roots that are this namespace's from now on but were not filled (nothing stored,
      or the disk is the truth) and do not carry its record yet."""

    filled: list[str]
    cleared: list[str]
    recorded: list[str]


def plan_finish(decisions: Sequence[RootDecision], disk: Mapping[str, Disk], candidates: Iterable[str],
                started: set[str]) -> Finish:
    candidates = set(candidates)
    order = [d.name for d in decisions]
    return Finish(
        filled=[n for n in order if n in candidates and n in started],
        cleared=[n for n in order if n in candidates and n not in started and disk[n].cut_short],
        recorded=[d.name for d in decisions if d.owned and not disk[d.name].held and d.name not in started],
    )


# -- restore points (docs/RESTORE.md, "Restoring from a point") ----------------------------------


class PointEntry(Protocol):
    """What the restore reads of one entry of a restore point's header (``sidecar.points.format.PointEntry``):
    its key, and the file's metadata (None: deleted since the point before)."""

    @property
    def key(self) -> str: ...
    @property
    def meta(self) -> ObjectMeta | None: ...


_E = TypeVar("_E", bound=PointEntry)


def chain_tree(headers: Iterable[Iterable[_E]]) -> dict[str, tuple[int, _E]]:
    """The tree a chain of points gives (``headers``: each point's entries, the full point first,
    then its incrementals in seq order): key -> (index of the point whose member holds its bytes,
    its entry). A later point's entry replaces an earlier one; a deletion removes the key."""
    tree: dict[str, tuple[int, _E]] = {}
    for i, entries in enumerate(headers):
        for e in entries:
            if e.meta is None:
                tree.pop(e.key, None)
            else:
                tree[e.key] = (i, e)
    return tree


def from_point(listed: ObjectInfo, entry: PointEntry | None, *, merging: bool, max_file_size: int) -> bool:
    """Whether a listed object of a root being filled is restored from the point that holds
    ``entry`` (its key's entry in the chain's tree; None: the chain has no such key) rather than
    from its own object: the same version, size and sha256 (so the same bytes), a sha256 known,
    and nothing else to decide (a merged root's files are compared with the disk one by one, a
    file above ``max_file_size`` is refused: both stay on the per-file path)."""
    m = None if entry is None else entry.meta
    return (m is not None and not merging and listed.sha256 is not None and listed.size <= max_file_size
            and (listed.version, listed.size, listed.sha256) == (m.version, m.size, m.sha256))


def holding_point(version: int, seqs: Sequence[int]) -> int | None:
    """The point of a chain (``seqs``: its increments' seqs, ascending) that should hold a per-file
    object stored at ``version``: the first written after it (a point's seq is a version the
    writer reserved once the store held its files). None when every point is older. Only a hint:
    its entry must still match the listed object (:func:`from_point`)."""
    i = bisect.bisect_right(seqs, version)
    return seqs[i] if i < len(seqs) else None


def point_source(listed: ObjectInfo, tree: Mapping[str, tuple[int, PointEntry]], *, merging: bool,
                 max_file_size: int) -> int | None:
    """For a listed object of a root being filled (the latest state): the index in the chain of
    the point it is taken from (:func:`from_point` with its key's entry in the chain's ``tree``),
    or None: fetched from its own object. A key the tree has but the listing has not is never
    asked for: deleted after the point, never restored."""
    held = tree.get(listed.key)
    if held is not None and from_point(listed, held[1], merging=merging, max_file_size=max_file_size):
        return held[0]
    return None


def as_of_refused(has_files: Mapping[str, bool], force: bool) -> list[str]:
    """The roots an as-of restore may not fill: those holding regular files, unless forced."""
    return [] if force else [name for name, files in has_files.items() if files]


def plan_as_of_finish(names: Sequence[str], started: set[str]) -> Finish:
    """What ``restore --as-of`` records once every file is in place: the roots it changed are
    flushed, recorded and unmarked; every other root is recorded (this namespace's disk from now
    on) and loses a marker an earlier run cut short left."""
    rest = [n for n in names if n not in started]
    return Finish(filled=[n for n in names if n in started], cleared=rest, recorded=rest)


def as_of_time(when: float | None, ago: float | None, store_now: float | None) -> float | None:
    """The moment ``restore --as-of`` means, on the store's clock: ``when`` as given, or ``ago``
    seconds before ``store_now`` (None when the store's time is not known)."""
    if when is not None:
        return when
    assert ago is not None
    return None if store_now is None else store_now - ago
