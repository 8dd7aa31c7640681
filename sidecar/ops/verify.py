"""``checkpoint-sidecar verify [--read-data] [--json]``: the check an operator runs before trusting a
store, after restic's ``check`` (docs/RESTORE.md, "Verifying a store").

Every namespace below ``SIDECAR_PREFIX`` (as ``sessions`` finds them: one listing grouped by
:func:`sidecar.ops.namespaces.groups`; ``FOUNDRY_AGENT_SESSION_ID`` never narrows it), one after the
other, each through its own read-only store (:func:`sidecar.ops.namespaces.namespace_store`):

1. its listing, each object's metadata checked (:func:`sidecar.ops.verifyplan.metadata_problems`);
   with ``--read-data`` every object's bytes streamed and hashed against its recorded sha256, a
   few at a time (``SIDECAR_CONCURRENCY``, at most :data:`PARALLEL`), each holding a chunk and
   one read ahead. One that does not match is read again once (a live sidecar may have replaced
   it meanwhile); one deleted since it was listed is not checked;
2. its restore points: each header read (:func:`sidecar.restore.points.open_point`, the one parser),
   every chain's links checked, each entry compared with the listed object of the same version;
   with ``--read-data`` each point streamed once, every member hashed against its entry and the
   whole object against its recorded sha256;
3. for each damaged object, the newest point that recovers it
   (:func:`sidecar.ops.verifyplan.recovering_point`).

One line per namespace (``ok`` or ``damaged``, then a line per damaged key, every name escaped),
and a summary; ``--json``: one object per namespace per line. Reads only: no store is created,
nothing is written, not even the store clock's temp file (no clock is needed). Memory: the
namespace's listing (a small record per object, to compare with the points' entries), a point
header or two, and two chunks per read in flight; no object is held whole.

Exit codes: 0 every namespace ok; :data:`EXIT_DAMAGED` some namespace is damaged; 1 the store is
not there or cannot be read, or holds no namespace below the prefix (nothing verified is never
taken for a sound store: a ``SIDECAR_STORE`` and a ``SIDECAR_PREFIX`` that lead nowhere agree); 2
bad configuration.
"""

from __future__ import annotations

import hashlib
import json
import time
from functools import partial
from typing import TYPE_CHECKING, AsyncIterator, Callable

import anyio

from sidecar import log
from sidecar.errors import EXIT_DAMAGED, EXIT_OK, fail, first_of
from sidecar.log import rfc3339
from sidecar.ops.namespaces import full_name, groups, namespace_store, start_operator, unsafe_name
from sidecar.ops.verifyplan import (
    BAD_BYTES,
    NAMESPACE,
    OBJECT,
    POINT,
    Damage,
    PointCheck,
    Report,
    elsewhere,
    entry_conflict,
    metadata_problems,
    point_problems,
    recovering_point,
    sound_points,
    unsafe_entry,
    version_lowered,
)
from sidecar.points.format import EntryMismatch, PointError, PointName, parse_point_key
from sidecar.restore.points import open_point
from sidecar.retry import retry_transient
from sidecar.store.base import NotFound, ObjectInfo, Store, StoreError, close_chunks
from sidecar.storeclient import open_store, printing
from sidecar.tarstream import drain

if TYPE_CHECKING:
    from sidecar.config import Settings

#: Objects (or points) read at once at most, each holding a chunk and one read ahead.
PARALLEL = 4
#: Chunks fetched ahead while an object is read (as a restore reads a point).
READ_AHEAD = 1
#: How long a read is retried while the store answers with transient errors.
RETRY_SECONDS = 30.0


# -- one namespace ---------------------------------------------------------------------------------

async def _digest(store: Store, key: str) -> tuple[ObjectInfo, int, str] | None:
    """The object's info as read, and the size and sha256 of its bytes, streamed; None when gone."""
    digest, size = hashlib.sha256(), 0
    try:
        async with await store.get_stream(key, READ_AHEAD) as (info, chunks):
            async for chunk in chunks:
                digest.update(chunk)
                size += len(chunk)
    except NotFound:
        return None
    return info, size, digest.hexdigest()


async def check_bytes(store: Store, key: str) -> list[str] | None:
    """What is wrong with the bytes of ``key`` (empty: they hash to its recorded sha256); None
    when it is gone. A mismatch, or a read that fails, is tried once more: a live sidecar may
    have replaced the object between the listing and the read, or during it."""
    for attempt in (1, 2):
        try:
            got = await retry_transient(lambda: _digest(store, key), "verify", time.monotonic() + RETRY_SECONDS)
        except StoreError:
            if attempt == 2:
                raise
            continue
        if got is None:
            return None
        info, size, sha = got
        if info.sha256 is not None and (size, sha) == (info.size, info.sha256):
            return []
        if attempt == 2:
            if info.sha256 is None:
                return metadata_problems(info)
            return [f"{BAD_BYTES} ({size} bytes read)" if size != info.size else BAD_BYTES]
    raise AssertionError("unreachable")


class _Hashing:
    """A tap for :func:`open_point`: the object's info kept, every chunk hashed as it is read
    (afresh at each GET)."""

    def __init__(self) -> None:
        self.info: ObjectInfo | None = None
        self.digest = hashlib.sha256()

    async def __call__(self, info: ObjectInfo, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        self.info, self.digest = info, hashlib.sha256()
        try:
            async for chunk in chunks:
                self.digest.update(chunk)
                yield chunk
        finally:
            await close_chunks(chunks)

    def mismatch(self) -> bool:
        """Whether the bytes read do not hash to the object's recorded sha256 (one it records)."""
        return self.info is not None and self.info.sha256 is not None and self.digest.hexdigest() != self.info.sha256


async def check_point(store: Store, name: PointName, info: ObjectInfo, read_data: bool,
                      listed: dict[str, ObjectInfo], interest: dict[str, int],
                      conflicts: dict[str, PointName]) -> PointCheck:
    """Read one point: its header always, every byte with ``read_data``. Its entries are compared
    with ``listed`` (a disagreement at the same version goes to ``conflicts``, the key's newest
    point), and those holding a key of ``interest`` at its version are noted. A read that fails
    part way is tried once more."""
    for attempt in (1, 2):
        try:
            return await _check_point(store, name, info, read_data, listed, interest, conflicts)
        except StoreError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


async def _check_point(store: Store, name: PointName, info: ObjectInfo, read_data: bool,
                       listed: dict[str, ObjectInfo], interest: dict[str, int],
                       conflicts: dict[str, PointName]) -> PointCheck:
    check = PointCheck(name, info)
    tap = _Hashing() if read_data else None
    try:
        opened = await retry_transient(lambda: open_point(store, name, READ_AHEAD if read_data else 0, tap),
                                       "verify", time.monotonic() + RETRY_SECONDS)
    except NotFound:
        check.gone = True
        return check
    except PointError as e:
        check.error = str(e)
        return check
    try:
        check.prev = opened.header.prev
        for entry in opened.header.entries:
            if (why := unsafe_entry(entry.key)) is not None:
                check.unsafe[entry.key] = why
        for entry in opened.header.files():
            if entry.key in listed:
                check.versions[entry.key] = entry.written.version
            if entry_conflict(listed.get(entry.key), entry) and name > conflicts.get(entry.key, PointName(-1, "", 0)):
                conflicts[entry.key] = name
            if interest.get(entry.key) == entry.written.version:
                check.holds.add(entry.key)
        if tap is not None:
            try:
                async for entry, body in opened.reader.files():
                    try:
                        await drain(body)
                    except EntryMismatch:
                        check.bad_entries.append(entry.key)
            except PointError as e:
                check.error = str(e)
            except NotFound:
                check.gone = True
            else:
                if tap.mismatch():
                    check.error = BAD_BYTES
    finally:
        await close_chunks(opened.chunks)
    return check


async def check_namespace(store: Store, namespace: str, is_namespace: Callable[[str], bool], read_data: bool,
                          parallel: int = PARALLEL) -> Report:
    """Verify one namespace through its own ``store`` (opened here); ``is_namespace``: whether a
    directory of its keys (relative to it) is a nested namespace, whose keys are left to it.
    Raises ``StoreError`` when the store cannot be read."""
    report = Report(namespace, read_data=read_data)
    listed: dict[str, ObjectInfo] = {}
    points: dict[PointName, ObjectInfo] = {}
    damage: dict[str, Damage] = {}
    limit = anyio.Semaphore(parallel)

    async def read(info: ObjectInfo) -> None:
        try:
            problems = await check_bytes(store, info.key)
        finally:
            limit.release()
        if problems is None:
            report.gone += 1
        elif problems:
            damage[info.key] = Damage(info.key, OBJECT, problems, info.version)

    await retry_transient(store.open, "open", time.monotonic() + RETRY_SECONDS)
    with first_of(StoreError):
        async with anyio.create_task_group() as tg:
            async for info in store.list():
                if elsewhere(info.key, is_namespace):
                    continue
                report.bytes += max(info.size, 0)
                name = parse_point_key(info.key)
                if name is not None:
                    points[name] = info
                    continue
                report.objects += 1
                listed[info.key] = info
                if problems := metadata_problems(info):
                    damage[info.key] = Damage(info.key, OBJECT, problems, info.version)
                elif read_data:
                    await limit.acquire()
                    tg.start_soon(read, info)
    report.points = len(points)

    interest = {k: d.version for k, d in damage.items()}
    conflicts: dict[str, PointName] = {}
    checks: dict[PointName, PointCheck] = {}

    async def point(name: PointName) -> None:
        async with limit:
            checks[name] = await check_point(store, name, points[name], read_data, listed, interest, conflicts)

    with first_of(StoreError):
        async with anyio.create_task_group() as tg:
            for name in sorted(points):
                tg.start_soon(point, name)
    report.gone += sum(c.gone for c in checks.values())
    for key, name in conflicts.items():
        problem = (f"its recorded size or sha256 differs from restore point {name.seq}'s entry of the same "
                   f"version {listed[key].version}")
        damage.setdefault(key, Damage(key, OBJECT, [], listed[key].version)).problems.append(problem)
    damaged_points = point_problems(checks)
    sound = sound_points(checks, damaged_points)
    highest: dict[str, tuple[int, PointName]] = {}
    for name in sound:
        for key, version in checks[name].versions.items():
            highest[key] = max(highest.get(key, (version, name)), (version, name))
    for key, (version, name) in highest.items():
        if listed[key].sha256 is None or key in conflicts:
            continue  # its metadata is unreadable, or differs from a point's at its version: said already
        if (lowered := version_lowered(listed[key], version, name)) is not None:
            damage.setdefault(key, Damage(key, OBJECT, [], listed[key].version)).problems.append(lowered)
            checks[name].holds.add(key)  # that point restores the key as it was written
    for d in damage.values():
        if d.key not in conflicts and (p := recovering_point(d.key, checks, sound)) is not None:
            d.recovered_by, d.recovered_at = p, points[p].modified
    report.damaged = sorted(damage.values(), key=lambda d: d.key)
    report.damaged += [Damage(p.key, POINT, damaged_points[p]) for p in sorted(damaged_points)]
    return report


# -- output ---------------------------------------------------------------------------------------

def as_json(report: Report, prefix: str) -> dict:
    """The ``--json`` object of one namespace."""

    def recovery(d: Damage) -> dict | None:
        p = d.recovered_by
        return None if p is None else {"point": p.key, "seq": p.seq, "time": rfc3339(d.recovered_at)}

    return {"namespace": full_name(prefix, report.namespace), "status": "ok" if report.ok else "damaged",
            "objects": report.objects, "points": report.points, "bytes": report.bytes, "read_data": report.read_data,
            "gone": report.gone,
            "damaged": [{"key": d.key, "kind": d.kind, "problems": d.problems,
                         **({"recovered_by": recovery(d)} if d.kind == OBJECT else {})} for d in report.damaged]}


def as_text(report: Report, prefix: str) -> list[str]:
    """The lines of one namespace: its verdict, then one per damaged key (every name escaped: a
    key cannot forge a line)."""
    name = log.printable(full_name(prefix, report.namespace) or "(top of the store)")
    gone = f", {report.gone} gone since listed" if report.gone else ""
    what = (f"{log.count(report.objects, 'object')}, {log.count(report.points, 'restore point')}, "
            f"{log.count(report.bytes, 'byte')}"
            f"{', every byte read' if report.read_data else ''}{gone}")
    if report.ok:
        return [f"ok       {name} ({what})"]
    out = [f"damaged  {name} ({what})"]
    for d in report.damaged:
        line = f"  {d.kind} {log.printable(d.key)}: {log.printable('; '.join(d.problems))}"
        if d.kind == OBJECT:
            if d.recovered_by is not None:
                line += f"; recoverable from restore point {d.recovered_by.seq} ({rfc3339(d.recovered_at)})"
            else:
                line += "; no restore point recovers it"
        out.append(line)
    return out


# -- the command ----------------------------------------------------------------------------------

async def reports(top: Store, store_for: Callable[[str], Store], read_data: bool,
                  parallel: int = PARALLEL) -> AsyncIterator[Report]:
    """Verify every namespace below ``top`` (opened), one after the other as the listing finds
    them (nested ones before the namespace around them), each through ``store_for(namespace)``
    (not opened; closed here). Raises ``StoreError``."""
    seen: set[str] = set()
    async for group in groups(top):
        ns = group.namespace

        def nested(directory: str, ns: str = ns) -> bool:
            return full_name(ns, directory) in seen

        if why := unsafe_name(ns):  # no store request can name it: said, the others go on
            report = Report(ns, group.objects, group.points, group.bytes,
                            damaged=[Damage(ns, NAMESPACE, [f"its name is no namespace's ({why}): not verified"])])
        else:
            store = store_for(ns)
            try:
                report = await check_namespace(store, ns, nested, read_data, parallel)
            finally:
                await store.aclose()
        seen.add(ns)
        yield report


async def command(settings: Settings, read_data: bool, as_json_lines: bool) -> int:
    """Verify every namespace (see the module docstring); the exit code."""
    started = start_operator(settings, "verify")
    if isinstance(started, int):
        return started
    settings = started
    prefix = settings.namespace.path
    top = open_store(settings, read_only=True)
    parallel = max(1, min(settings.concurrency, PARALLEL))
    count = damaged = 0

    async def body() -> None:
        nonlocal count, damaged
        async for report in reports(top, partial(namespace_store, settings, prefix, concurrency=parallel), read_data,
                                    parallel):
            count += 1
            damaged += not report.ok
            if as_json_lines:
                print(json.dumps(as_json(report, prefix)), flush=True)
            else:
                print("\n".join(as_text(report, prefix)), flush=True)

    opening = partial(retry_transient, top.open, "open", time.monotonic() + RETRY_SECONDS)
    if (failed := await printing(top, body, f"cannot verify {top.description}", "cannot write the report",
                                 opening)) is not None:
        return failed
    if not count:  # as for a store that is not there: nothing verified is never a sound store
        shown = log.printable(prefix) or "(top of the store)"
        return fail(f"no namespace below the prefix {shown!r} in {top.description}: nothing was verified (check "
                    "SIDECAR_STORE and SIDECAR_PREFIX)")
    if not as_json_lines:
        scope = "every byte read" if read_data else "metadata and restore point headers; --read-data reads every byte"
        print(f"verify: {log.count(count, 'namespace')}, {count - damaged} ok, {damaged} damaged ({scope})", flush=True)
    return EXIT_DAMAGED if damaged else EXIT_OK
