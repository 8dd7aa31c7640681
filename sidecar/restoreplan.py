"""The restore's decisions, apart from its I/O (``restorer.py`` applies them): which roots may be
filled, what each stored file becomes, which roots are restored once the listing has ended, and
what is recorded on disk afterwards. Pure; the rule per root is :func:`sidecar.plan.decide_restore`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping, Sequence

from sidecar.plan import RootDecision, decide_restore
from sidecar.restorefs import Lineage


@dataclass(frozen=True)
class Disk:
    """What the disk says of one root before the restore: whether it holds regular files, whether
    an earlier restore into it was cut short, and whether it carries this store and namespace's
    lineage record (``held``)."""

    has_files: bool
    cut_short: bool
    held: bool


@dataclass(frozen=True)
class Candidates:
    """The roots the disk lets the restore fill, if anything is stored for them (known from the
    disk alone, so downloads begin with the listing's first page), and those of them merged (a
    local file with the stored bytes is left in place)."""

    roots: frozenset[str]
    merging: frozenset[str]


def holds(record: Lineage | None, lineage: Lineage, marker_generation: int) -> bool:
    """Whether a root whose lineage record is ``record`` is held (the truth, see
    :func:`~sidecar.plan.decide_restore`) by a sidecar of ``lineage``, when the namespace's owner
    marker was at ``marker_generation`` before the restore: the same store and namespace, and a
    generation no older than the marker's. A disk that holds an older state of this namespace (a
    copy taken earlier, a node's disk another compute of the session moved on from) is not, nor is
    one whose record carries no generation."""
    return (record is not None and record.store == lineage.store and record.namespace == lineage.namespace
            and record.generation is not None and record.generation >= marker_generation)


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
    return [decide_restore(name, d.has_files, stored[name], mode, d.cut_short, d.held) for name, d in disk.items()]


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


def superseded(bundle: Mapping[str, object] | None, key: str) -> bool:
    """Whether the root's bundle (its changes by key; None while not read) names ``key``: its newer
    version is placed from the bundle, or the bundle deletes it, so its own object is not restored."""
    return bundle is not None and key in bundle


def names_generated(key: str, streamed: bool) -> bool:
    """Whether a restored file is searched for a generated workflow name: a checkpoint held in memory."""
    return not streamed and (key.startswith(".checkpoints/") or key.endswith(".json"))


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
