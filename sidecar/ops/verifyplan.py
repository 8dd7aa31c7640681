"""The pure rules of ``checkpoint-sidecar verify`` (docs/RESTORE.md, "Verifying a store"): what is
wrong with a listed object's metadata, which keys of a namespace's listing are another's, which
restore points are damaged or break their chain, and which point recovers a damaged object. No
I/O: :mod:`sidecar.ops.verify` reads the store and feeds these.

A point *recovers* a damaged object when it holds an entry of the object's key at the object's
version, and ``restore --as-of`` of that point would succeed: every point of its chain up to it
is there, readable, follows the point before it and is not damaged (with ``--read-data``: every
member's bytes hash to their entry's sha256, and the object to its recorded one). The newest such
point is named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from sidecar.ops.sessionplan import RECORDS_DIR
from sidecar.paths import Root, UnsafeKey, split_key
from sidecar.points.format import PointEntry, PointName
from sidecar.points.plan import chains, link_error
from sidecar.store.base import ObjectInfo, sane_version

_SHA256 = re.compile(r"[0-9a-f]{64}")
OBJECT, POINT, NAMESPACE = "object", "point", "namespace"
NO_SHA256 = "no sha256 recorded (its metadata is missing or unreadable): the store cannot vouch for its bytes"
BAD_BYTES = "its bytes do not hash to its recorded sha256"


def metadata_problems(info: ObjectInfo) -> list[str]:
    """What is wrong with a listed object's own metadata (the sidecar's: sha256, version, size)."""
    out = []
    if info.sha256 is None:
        out.append(NO_SHA256)
    elif not _SHA256.fullmatch(info.sha256):
        out.append("its recorded sha256 is malformed")
    if not sane_version(info.version):
        out.append(f"its recorded version {info.version} is out of the range a sidecar writes")
    if info.size < 0:
        out.append(f"its size {info.size} is negative")
    return out


def unsafe_entry(key: str) -> str | None:
    """Why a point's entry key would be refused by a restore (a path out of its root, ``..``, an
    absolute or empty component, a reserved or internal name: :func:`sidecar.paths.split_key`,
    whatever roots are configured); None when it is a plain key. Such an entry is damage."""
    first = key.split("/", 1)[0]
    try:
        split_key(key, {first: Root(first, "/")})
    except UnsafeKey as e:
        return str(e)
    return None


def version_lowered(listed: ObjectInfo, recorded: int, point: PointName) -> str | None:
    """Why a listed object's recorded version, below the version a sound restore point records
    for its key, cannot be right: a put never lowers a key's version, and a point is written after
    the objects it holds, so its metadata was changed (a version field edited, or one a store
    cannot parse, taken for 0); None when it is not below."""
    if listed.version >= recorded:
        return None
    return (f"its recorded version {listed.version} is below the version {recorded} restore point {point.seq} "
            "records for it: a put never lowers a version, so its metadata was changed")


def elsewhere(key: str, is_namespace: Callable[[str], bool]) -> bool:
    """Whether a key of a namespace's listing is not the namespace's own: it lies in a nested
    namespace (``is_namespace`` of one of its directories, relative to this namespace: verified on
    its own), or it is a directory store's record (``.sidecar-meta``), never an object."""
    parts = key.split("/")
    if RECORDS_DIR in parts[:-1]:
        return True
    return any(is_namespace("/".join(parts[:i])) for i in range(1, len(parts)))


def entry_conflict(listed: ObjectInfo | None, entry: PointEntry) -> bool:
    """Whether a point's file entry and the listed object of its key disagree although they are
    the same write (the same version, not 0): their sizes or sha256s differ, so one of them is
    recorded wrong. An object without a sha256 is damaged already and not compared."""
    if listed is None or entry.meta is None or listed.sha256 is None:
        return False
    m = entry.meta
    return m.version != 0 and listed.version == m.version and (listed.size, listed.sha256) != (m.size, m.sha256)


@dataclass
class PointCheck:
    """What reading one point found: its header's ``prev`` (None: not read), why it is
    unreadable, the entries whose bytes do not match, whether it vanished since it was listed,
    and the keys of interest (damaged objects) it holds at their objects' versions."""

    name: PointName
    info: ObjectInfo
    prev: int | None = None
    error: str | None = None
    bad_entries: list[str] = field(default_factory=list)
    gone: bool = False
    holds: set[str] = field(default_factory=set)
    #: entries a restore would refuse (key: why)
    unsafe: dict[str, str] = field(default_factory=dict)
    #: each listed key's version as this point records it
    versions: dict[str, int] = field(default_factory=dict)


def point_problems(checks: Mapping[PointName, PointCheck]) -> dict[PointName, list[str]]:
    """Each point's problems (empty: sound on its own): its metadata, unreadable, members that do
    not match, not following the point listed before it in its chain (a point missing), or an
    incremental whose full point is gone. A point gone since it was listed has none."""
    out: dict[PointName, list[str]] = {}
    in_chain: set[PointName] = set()
    for chain in chains(checks):
        before: PointName | None = None
        for p in chain.points:
            in_chain.add(p)
            c = checks[p]
            if c.prev is not None and (broken := link_error(c.prev, before)) is not None:
                out.setdefault(p, []).append(f"{broken} (the chain of full point {chain.full.seq} is incomplete)")
            before = p
    for name, c in checks.items():
        if c.gone:
            out.pop(name, None)
            continue
        problems = out.setdefault(name, [])
        problems[:0] = metadata_problems(c.info) + ([c.error] if c.error else [])
        problems += [f"entry {k!r} does not match its sha256" for k in c.bad_entries]
        problems += [f"entry {k!r} is no safe path ({why}): a restore refuses it" for k, why in c.unsafe.items()]
        if name not in in_chain:
            problems.append(f"its full point {name.base} is gone")
    return {n: p for n, p in out.items() if p}


def sound_points(checks: Mapping[PointName, PointCheck], problems: Mapping[PointName, list[str]]) -> set[PointName]:
    """The points ``restore --as-of`` could restore: every point of the chain up to it present
    and without problems."""
    out: set[PointName] = set()
    for chain in chains(checks):
        for p in chain.points:
            if checks[p].gone or problems.get(p):
                break
            out.add(p)
    return out


def recovering_point(key: str, checks: Mapping[PointName, PointCheck], sound: Iterable[PointName]) -> PointName | None:
    """The newest sound point that holds ``key`` at its damaged object's version (see
    :class:`PointCheck`'s ``holds``), or None."""
    return max((p for p in sound if key in checks[p].holds), default=None)


@dataclass
class Damage:
    """A damaged key of a namespace: an object or a point, what is wrong with it, and for an
    object the point that recovers it (None: none does)."""

    key: str
    kind: str
    problems: list[str]
    version: int = 0
    recovered_by: PointName | None = None
    recovered_at: float | None = None  # that point's time (store clock)


@dataclass
class Report:
    """One namespace's verdict: what was checked and what is damaged (empty: ok)."""

    namespace: str
    objects: int = 0
    points: int = 0
    bytes: int = 0
    read_data: bool = False
    gone: int = 0  # objects and points deleted (or replaced) since they were listed: not checked
    damaged: list[Damage] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.damaged
