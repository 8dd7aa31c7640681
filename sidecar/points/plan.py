"""Restore points' plans (pure): which chain to restore (:func:`choose_for_latest`,
:func:`choose_as_of`, for what :class:`AsOf` names), which points retention deletes (:func:`retention_plan`), and when the next
point is a full one (:func:`full_due`). Over the names :mod:`sidecar.points.format` gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from sidecar.points.format import PointName


# -- plans ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AsOf:
    """What ``restore --as-of`` names, exactly one of: a store time (``when``, epoch seconds), a
    duration before the store's now (``ago``, seconds), or a point by its seq (``seq``, as
    ``history`` lists it: the only way to tell apart two points in one second of the store's
    clock, whose Last-Modified has whole seconds on Azure)."""

    when: float | None = None
    ago: float | None = None
    seq: int | None = None


@dataclass(frozen=True)
class Chain:
    """A full point and the incremental points whose base names it, in seq order."""

    full: PointName
    incrs: tuple[PointName, ...] = ()

    @property
    def points(self) -> tuple[PointName, ...]:
        return (self.full, *self.incrs)

    @property
    def newest(self) -> PointName:
        return self.incrs[-1] if self.incrs else self.full

    def upto(self, point: PointName) -> tuple[PointName, ...]:
        """The points to read for ``point`` (one of this chain's): the full and every
        incremental up to it, in seq order."""
        return tuple(p for p in self.points if p.seq <= point.seq)


def link_error(prev: int, before: PointName | None) -> str | None:
    """Why a point of a chain whose header's ``prev`` is ``prev`` does not follow ``before``, the
    chain's point listed before it (None: it is the chain's first), or None when it does: an
    incremental's ``prev`` names the point before it, so a chain missing a point is found, never
    applied."""
    if before is None or prev == before.seq:
        return None
    return f"it follows point {prev}, which its chain lacks"


def chains(points: Iterable[PointName]) -> list[Chain]:
    """The chains of ``points``, oldest first. An incremental whose full point is not among them
    is in no chain (unusable)."""
    points = list(points)
    fulls = {p.seq: p for p in points if p.full}
    incrs: dict[int, list[PointName]] = {}
    for p in points:
        if not p.full and p.base in fulls:
            incrs.setdefault(p.base, []).append(p)
    return [Chain(fulls[s], tuple(sorted(set(incrs.get(s, []))))) for s in sorted(fulls)]


def _chain_of(all_chains: list[Chain]) -> dict[PointName, Chain]:
    return {p: c for c in all_chains for p in c.points}


def _newest_usable(candidates: Iterable[PointName], of: dict[PointName, Chain],
                   unusable: Iterable[PointName]) -> tuple[PointName, ...]:
    bad = {p.seq for p in unusable}
    for p in sorted(candidates, reverse=True):
        c = of.get(p)
        if c is not None and not any(q.seq in bad for q in c.upto(p)):
            return c.upto(p)
    return ()


def choose_for_latest(points: Iterable[PointName], unusable: Iterable[PointName] = ()) -> tuple[PointName, ...]:
    """The points to read for the latest state: the newest point (by seq) whose chain up to it
    holds no ``unusable`` point (found so by a reader: call again with it to fall back), as its
    full point and incrementals in seq order; empty when there is none."""
    pts = list(points)
    return _newest_usable(pts, _chain_of(chains(pts)), unusable)


def choose_as_of(points_with_times: Mapping[PointName, float | None] | Iterable[tuple[PointName, float | None]],
                 t: float, unusable: Iterable[PointName] = ()) -> tuple[PointName, ...]:
    """The points to read for the state as of store time ``t``: the newest point whose time
    (its object's ``modified``) is at or before ``t`` and whose chain up to it is usable, as for
    :func:`choose_for_latest`; empty when there is none. A point without a time is never chosen."""
    times = dict(points_with_times.items() if isinstance(points_with_times, Mapping) else points_with_times)
    of = _chain_of(chains(times))
    return _newest_usable([p for p, pt in times.items() if pt is not None and pt <= t], of, unusable)


@dataclass(frozen=True)
class Retention:
    """How long points are kept (seconds): every point younger than ``keep_all``, the newest of
    each hour younger than ``hourly``, the newest of each day younger than ``daily``. The newest
    point is always kept, and every point a kept one's chain needs."""

    keep_all: float = 3600.0
    hourly: float = 86400.0
    daily: float = 7 * 86400.0


def retention_now(points_with_times: Mapping[PointName, float | None]) -> float | None:
    """Retention's "now": the store time of the newest point (by seq: the one just written). A
    time ahead of it on an older point (a store written while its clock ran ahead, or copied
    from one) never stands for now, which would age every recent point out at once; such a
    point's own age is not known, so it is kept. None when the newest point has no time."""
    if not points_with_times:
        return None
    return points_with_times[max(points_with_times)]


def retention_plan(points_with_times: Mapping[PointName, float | None] | Iterable[tuple[PointName, float | None]],
                   now: float, rules: Retention = Retention()) -> list[PointName]:
    """The points to delete, newest first, given each point's store time and the store's
    ``now`` (e.g. the newest point's time). Deleted in this order, a chain only ever loses its
    newest points: what is left of it stays usable, even to a listing that runs meanwhile.
    Kept: see :class:`Retention`; a point without a time is kept (its age is not known); every
    point of a kept point's chain up to it is kept. An incremental outside any chain is kept
    while younger than ``keep_all`` (a writer may be putting its chain), deleted after."""
    times = dict(points_with_times.items() if isinstance(points_with_times, Mapping) else points_with_times)
    of = _chain_of(chains(times))
    kept: set[PointName] = {p for p, t in times.items() if t is None or now - t <= rules.keep_all}
    usable = sorted((p for p in times if p in of), reverse=True)  # newest first
    if usable:
        kept.add(usable[0])
    for span, bucket in ((rules.hourly, 3600.0), (rules.daily, 86400.0)):
        seen: set[int] = set()
        for p in usable:
            t = times[p]
            if t is None or now - t > span:
                continue
            b = int(t // bucket)
            if b not in seen:  # the newest of its bucket
                seen.add(b)
                kept.add(p)
    for p in list(kept):
        if p in of:
            kept.update(of[p].upto(p))
    return sorted((p for p in times if p not in kept), reverse=True)


# -- compaction -------------------------------------------------------------------------------
#: A chain never grows beyond this many incrementals: the next point is a full one.
MAX_CHAIN_INCRS = 2000


def full_due(*, full_bytes: int, incr_bytes: int, incrs: int, full_age: float, full_interval: float,
             tree_bytes: int) -> bool:
    """Whether the next point should be a full one rather than an incremental: the chain's
    incrementals hold more bytes than a full point of the tree would (``tree_bytes``; reading the
    chain costs more than a new full), or more than the full point itself did, or it is
    :data:`MAX_CHAIN_INCRS` long, or its full point is ``full_interval`` old (0: never for age)."""
    if incrs >= MAX_CHAIN_INCRS:
        return True
    if incr_bytes > max(full_bytes, tree_bytes):
        return True
    return full_interval > 0 and full_age >= full_interval
