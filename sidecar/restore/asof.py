"""``restore --as-of``: the roots filled with the namespace as it was at a time, from the tree of
the newest restore point at or before it (store clock), its chain applied, bytes from the points
only: read newest point first, one stream at a time, so that each key's newest entry decides it.
Reads only the store. Its files go through the restore's one placer (:mod:`.place`) and its end
through the one finish (:mod:`.finish`)."""

from __future__ import annotations

import datetime
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import AsyncIterator

import anyio
import anyio.to_thread

from sidecar import log
from sidecar.localfs import has_regular_files, local_matches, root_failure
from sidecar.log import rfc3339
from sidecar.paths import LINEAGE_FILE, IgnoreRules, Root, UnsafeKey, is_within, split_key
from sidecar.points.format import PointEntry, PointError, PointHeader, PointName
from sidecar.points.plan import AsOf, choose_as_of, link_error
from sidecar.restore import plan
from sidecar.restore.finish import finish
from sidecar.restore.place import Placer
from sidecar.restore.plan import foreign
from sidecar.restore.points import READ_AHEAD, list_points, open_point, read_header, unusable
from sidecar.restorefs import (
    Aside,
    CannotSetAside,
    Lineage,
    aside_parent,
    clear_restoring,
    mark_restoring,
    plan_aside,
    read_lineage,
    remove_stale_restore_temps,
    restore_cut_short,
    set_aside,
)
from sidecar.store.base import NotFound, ObjectInfo, ObjectMeta, Store, StoreError, close_chunks

__all__ = ["AsOfError", "AsOfResult", "aside_line", "recorded_roots", "restore_as_of", "rfc3339"]


class AsOfError(Exception):
    """``restore --as-of`` cannot fill the roots (one line: no point at or before the time, a root
    holds files, a point unreadable)."""



async def _first_unreadable(store: Store, chain: tuple[PointName, ...],
                            headers: list[PointHeader]) -> PointName | None:
    """The first point of ``chain`` that is unreadable, cut short, or does not follow the point
    before it (its ``prev``: a chain missing a point gives a wrong tree); warned. The headers
    read are added to ``headers``."""
    before = None
    headers.clear()
    for name in chain:
        try:
            header = await read_header(store, name)
            if (broken := link_error(header.prev, before)) is not None:
                raise PointError(broken)
        except (PointError, NotFound) as e:
            unusable(name, e)
            return name
        headers.append(header)
        before = name
    return None


async def recorded_roots(roots: list[Root], lineage: Lineage) -> tuple[str | None, bool]:
    """What the roots' lineage records say before an as-of restore: a refusal (one line) for a
    root recorded as another store's or namespace's disk, whose sidecar may be mirroring it even
    while it is empty (what the restore placed would cross into that namespace); and whether any
    root is recorded as this namespace's (its owner, if live, may be mirroring it)."""
    ours = False
    for root in roots:
        record = await anyio.to_thread.run_sync(read_lineage, root)
        if record is None:
            continue
        if foreign(record, lineage):
            theirs = f"'{log.printable(record.namespace) or '(top of the store)'}' of {log.printable(record.store)}"
            return (f"the root {log.printable(root.path)} is recorded as the disk of the store namespace {theirs} "
                    f"({root.path}/{LINEAGE_FILE}), whose sidecar may be mirroring it: what this restore placed "
                    "would cross into that namespace. Restore into another directory, or remove the record first "
                    "if that namespace is done with this disk"), ours
        ours = True
    return None, ours


@dataclass
class AsOfResult:
    """What ``restore --as-of`` did: the point restored (and its time), files and bytes placed,
    and (``--force-restore``) what each root held that differs from the point, moved beside it."""

    point: PointName
    time: float | None
    files: int = 0
    bytes: int = 0
    refused: int = 0
    aside: list[Aside] = field(default_factory=list)


async def store_now(store: Store) -> float | None:
    """The store's current time, by its own clock (``Store.now``)."""
    return float(await store.now())


async def restore_as_of(store: Store, roots: list[Root], when: float | None, ago: float | None, *,
                        force: bool, lineage: Lineage, ignore: IgnoreRules | None = None,
                        deadline: float = 0.0, seq: int | None = None) -> AsOfResult:
    """Fill ``roots`` with the namespace as it was at ``when`` (or ``ago`` seconds before the
    store's now, or at the point ``seq``): the newest point at or before it, its chain applied. Roots holding files are
    refused unless ``force``, which makes each root equal the point's tree: what a root holds
    that the point lacks or holds with other bytes (ignored names aside) is moved into a directory beside it
    (:func:`_set_aside`), the point's files written over the rest. Reads only the store; each root
    gets the restore marker before its first change and, once its files are flushed, ``lineage``
    (this namespace's disk from now on: a sidecar started on it mirrors it). :class:`AsOfError`
    when it cannot."""
    ignore = ignore or IgnoreRules()
    has_files = {r.name: await anyio.to_thread.run_sync(has_regular_files, r.path, ignore) for r in roots}
    if refused := plan.as_of_refused(has_files, force):
        paths = ", ".join(r.path for r in roots if r.name in refused)
        raise AsOfError(f"refusing to restore as of a time into roots that hold files ({paths}); "
                        "--force-restore makes them equal the point (what differs is moved beside them)")
    points = await list_points(store, deadline)
    headers: list[PointHeader] = []
    chosen = await _choose(store, points, AsOf(when, ago, seq), headers)
    result = AsOfResult(chosen[-1], points[chosen[-1]].modified)
    for root in roots:
        await anyio.to_thread.run_sync(remove_stale_restore_temps, root)
    started: dict[str, Root] = {}
    if force:
        tree = {key: entry for key, (_, entry) in plan.chain_tree(h.entries for h in headers).items()}
        await _set_aside(roots, tree, ignore, started, result)
    placer = Placer(AsOfError, lambda key, size: _refused(result), after="; the roots keep their restore marker")
    try:
        await _place_chain(store, chosen, {r.name: r for r in roots}, started, placer, result)
    finally:
        placer.close()
    if result.refused:  # the roots are not the point's tree: never recorded as this namespace's disk
        raise AsOfError(f"{log.count(result.refused, 'file')} of the point could not be placed (restore_refused_* in "
                        f"the log: a name unsafe here, or something in its way that is not the sidecar's to move)"
                        f"{_again(started) or ' (nothing was recorded as this namespace’s disk)'}")
    # every file in place: flushed, recorded as this namespace's, marker removed
    await finish(plan.plan_as_of_finish([r.name for r in roots], set(started)), {r.name: r for r in roots}, lineage)
    return result


def _refused(result: AsOfResult) -> None:
    result.refused += 1


async def _choose(store: Store, points: dict[PointName, ObjectInfo], as_of: AsOf,
                  headers: list[PointHeader]) -> tuple[PointName, ...]:
    """The chain of the newest usable point at or before the time meant (on the store's clock) or
    the seq named, every point of it checked before a file is written (their headers into
    ``headers``)."""
    times: dict[PointName, float | None]
    if as_of.seq is not None:  # a point by its seq: "at or before" in seq order
        t = float(as_of.seq)
        times = {n: float(n.seq) for n in points}
    else:
        meant = as_of.when if as_of.when is not None else plan.as_of_time(None, as_of.ago, await store_now(store))
        if meant is None:
            raise AsOfError("the store's current time is not known (it holds no object with a time): give the "
                            "time as RFC 3339 instead of a duration ago")
        t = meant
        # to the millisecond, as history shows them: the time a point is listed with selects it
        times = {n: None if i.modified is None else math.floor(i.modified * 1000) / 1000 for n, i in points.items()}
    bad: list[PointName] = []
    while chosen := choose_as_of(times, t, bad):
        if (failed := await _first_unreadable(store, chosen, headers)) is None:
            return chosen
        bad.append(failed)
    unusable = f"; unusable: {', '.join(b.key for b in bad)}" if bad else ""
    if as_of.seq is not None:
        oldest = f"the oldest is seq {min(points).seq}" if points else "the namespace has none"
        raise AsOfError(f"no restore point at or before seq {as_of.seq} in {store.description} "
                        f"({oldest}{unusable})")
    known = [i.modified for i in points.values() if i.modified is not None]
    oldest = f"the oldest is at {rfc3339(min(known))}" if known else "the namespace has none"
    raise AsOfError(f"no restore point at or before {rfc3339(t)} in {store.description} ({oldest}{unusable})")


async def _place_chain(store: Store, chosen: tuple[PointName, ...], by_name: dict[str, Root],
                       started: dict[str, Root], placer: Placer, result: AsOfResult) -> None:
    """Read the chain's points newest first, one stream at a time, so that each key's newest entry
    decides it, and place the files it gives."""
    decided: set[str] = set()  # keys a newer point of the chain decided (written or deleted)
    for name in reversed(chosen):
        try:
            opened = await open_point(store, name, READ_AHEAD)
        except (PointError, NotFound) as e:
            raise AsOfError(f"restore point {name.key} is unreadable: {e}{_again(started)}") from None
        except StoreError as e:
            raise AsOfError(f"cannot read restore point {name.key}: {_once(e)}{_again(started)}") from None
        try:
            fresh = {e.key for e in opened.header.entries if e.key not in decided}
            decided |= fresh
            async for entry, body in opened.reader.files():
                if entry.key in fresh:
                    await _place(entry, body, by_name, started, placer, result)
        except PointError as e:
            raise AsOfError(f"restore point {name.key} is unreadable: {e}{_again(started)}") from None
        except StoreError as e:  # (on Azure: the point changed while it was read)
            raise AsOfError(f"restore point {name.key} could not be read to its end: {_once(e)}"
                            f"{_again(started)}") from None
        finally:
            await close_chunks(opened.chunks)


async def _place(entry: PointEntry, body: AsyncIterator[bytes], by_name: dict[str, Root],
                 started: dict[str, Root], placer: Placer, result: AsOfResult) -> None:
    """Write one file of the as-of tree into its root (never outside it), verified against its entry."""
    first = entry.key.split("/", 1)[0]
    if first not in by_name:
        return  # a root not configured here
    try:
        root, parts = split_key(entry.key, by_name)
    except UnsafeKey as e:
        log.error("restore_refused_name", path=log.no_surrogates(entry.key), reason=str(e))
        result.refused += 1
        return
    if root.name not in started:
        try:
            mark_restoring(root)
        except OSError as e:
            raise AsOfError(f"cannot write into {root.path}: {root_failure(root.path, e)}") from None
        started[root.name] = root
    m = entry.written
    if await placer.entry(root, parts, ObjectInfo(entry.key, m.size, m.sha256, m.mtime_ns, m.mode), body,
                          PointError) is not None:
        result.files += 1
        result.bytes += m.size


async def _set_aside(roots: list[Root], tree: dict[str, PointEntry], ignore: IgnoreRules, started: dict[str, Root],
                     result: AsOfResult) -> None:
    """Move what each root holds that the point's ``tree`` lacks, and its files whose bytes differ
    from the point's, into a directory beside it
    (:func:`~sidecar.restorefs.set_aside`): every root is planned before any is changed (a root
    that cannot be: AsOfError, nothing changed), then each root gets its restore marker and its
    moves. A run cut short keeps the marker; run again, it moves what is left (into a new directory)."""
    plans = []
    real = [os.path.realpath(r.path) for r in roots]
    for root in roots:
        keep = {k.split("/", 1)[1]: e.written for k, e in tree.items() if k.startswith(root.name + "/")}

        def differs(rel: str, root: Root = root, keep: dict[str, ObjectMeta] = keep) -> bool:
            return local_matches(root, rel.split("/"), keep[rel].size, keep[rel].sha256) is not True

        try:
            plans.append(aside := await anyio.to_thread.run_sync(plan_aside, root, set(keep), ignore, differs))
        except CannotSetAside as e:
            raise AsOfError(f"{e} (nothing was changed)") from None
        if aside.paths and any(is_within(aside_parent(root), r) for r in real):  # (a root reached through a link)
            raise AsOfError(f"cannot move what {log.printable(root.path)} holds that the point lacks beside it: "
                            f"{log.printable(aside_parent(root))} lies in a root (nothing was changed)")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")  # a name only
    for aside in plans:
        if not aside.paths:
            continue
        root = aside.root
        marked = restore_cut_short(root)
        try:
            mark_restoring(root)
        except OSError as e:
            raise AsOfError(f"cannot write into {root.path}: {root_failure(root.path, e)}{_again(started)}") from None
        try:
            await anyio.to_thread.run_sync(set_aside, aside, stamp)
        except CannotSetAside as e:
            if e.moved == 0 and not marked:
                clear_restoring(root)  # this root as it was
            else:
                started[root.name] = root
            if not started:
                raise AsOfError(f"{e} (nothing was changed)") from None
            raise AsOfError(f"{e} ({e.moved} entries were moved there){_again(started)}") from None
        started[root.name] = root
        result.aside.append(aside)
        log.info("restore_as_of_set_aside", root=root.path, into=log.printable(aside.into), entries=aside.moved)


#: ``restore --as-of --force-restore`` names at most this many of the entries it moved out of a root.
SHOWN_ASIDE = 20


def aside_line(aside: Aside, shown: int = SHOWN_ASIDE) -> str:
    """What was moved out of a root (absent from the point, or holding other bytes), in one line:
    how many entries, where to, and the first ``shown`` of their paths (sorted, escaped; a
    directory with a trailing ``/``)."""
    paths = sorted(aside.paths)
    names = ", ".join(_quoted(p) for p in paths[:shown])
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    what = "entry that differs" if aside.moved == 1 else "entries that differ"
    return (f"moved {aside.moved} {what} from the point out of "
            f"{log.printable(aside.root.path)} into {log.printable(aside.into)}: {names}{more}")


def _quoted(path: str) -> str:
    """A path in double quotes, told apart from every other (a backslash, a quote, a comma, a
    control character escaped; :func:`~sidecar.log.printable` for the rest)."""
    return '"' + log.printable(json.dumps(path, ensure_ascii=False)[1:-1]) + '"'


def _again(started: dict[str, Root]) -> str:
    """What an as-of restore that failed after changing a root leaves, and how to finish it (a
    plain rerun is refused when the roots hold files; a forced one moves aside what is left)."""
    if not started:
        return ""
    return (" (the roots keep their restore marker and the files placed or moved aside so far: run it again "
            "with --force-restore)")


def _once(e: StoreError) -> str:
    """A store error's text for a command that does not retry it (no "will retry")."""
    return re.sub(r";? will retry( later)?$", "", str(e))
