"""``checkpoint-sidecar history [--json]``: the namespace's restore points, newest first.

One listing of ``.sidecar/points/``, then the header (the first tar member) of each point, read
four at a time (at most ``SIDECAR_CONCURRENCY``) and the rest of its object never fetched: its
file count. One line per
point: its time (the store's Last-Modified, RFC 3339 UTC), kind, files, bytes (the point object's
size) and seq; ``--json`` one JSON object per line. Reads only.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import anyio

from sidecar.errors import EXIT_OK, fail
from sidecar.storeclient import missing, open_store

if TYPE_CHECKING:
    from sidecar.config import Settings
    from sidecar.points.format import PointName
    from sidecar.store.base import ObjectInfo


def row(name: PointName, info: ObjectInfo, files: int | None, deleted: int | None, error: str | None,
        in_chain: bool) -> dict:
    """One point as ``history --json`` prints it."""
    from sidecar.log import rfc3339

    out: dict = {"time": rfc3339(info.modified), "kind": name.kind, "files": files, "bytes": info.size,
                 "seq": name.seq, "base": name.base, "key": info.key}
    if deleted:
        out["deleted"] = deleted
    if error is not None:
        out["unreadable"] = error
    elif not in_chain:
        out["unreadable"] = "its full point is gone"
    return out


def line(r: dict) -> str:
    """One point as ``history`` prints it."""
    files = "?" if r["files"] is None else str(r["files"])
    text = f"{r['time']}  {r['kind']:<4}  {files:>7} files  {r['bytes']:>12} bytes  seq {r['seq']}"
    if r.get("deleted"):
        text += f"  ({r['deleted']} deleted)"
    if "unreadable" in r:
        text += f"  unusable: {r['unreadable']}"
    return text


async def command(settings: Settings, as_json: bool) -> int:
    """List the restore points; exit 0 (none is fine), 1 when the store cannot be read or is not there."""
    from sidecar import log
    from sidecar.points.format import PointError
    from sidecar.points.plan import chains
    from sidecar.restore.points import list_points, read_header
    from sidecar.retry import STARTUP_RETRY_SECONDS, retry_transient
    from sidecar.store.base import NotFound, StoreError

    store = open_store(settings, read_only=True)
    deadline = time.monotonic() + STARTUP_RETRY_SECONDS
    try:
        await retry_transient(store.open, "open", deadline)
        if why := await missing(store):  # "no restore points" would hide a typo in SIDECAR_STORE
            return fail(why)
        points = await list_points(store, deadline)
        in_chain = {p for c in chains(points) for p in c.points}
        headers: dict[PointName, tuple[int | None, int | None, str | None]] = {}
        limit = anyio.Semaphore(min(settings.concurrency, 4))  # each read holds a chunk (4 MiB) at most

        async def header(name: PointName) -> None:
            async with limit:
                try:
                    h = await read_header(store, name)
                    files = len(h.files())
                    headers[name] = (files, len(h.entries) - files, None)
                except PointError as e:
                    headers[name] = (None, None, log.printable(str(e)))
                except NotFound:
                    headers[name] = (None, None, "deleted since it was listed")

        async with anyio.create_task_group() as tg:
            for name in points:
                tg.start_soon(header, name)
    except StoreError as e:
        return fail(f"cannot list the restore points in {store.description}: {e}")
    finally:
        await store.aclose()
    try:
        for name in sorted(points, reverse=True):
            r = row(name, points[name], *headers[name], in_chain=name in in_chain)
            print(json.dumps(r) if as_json else line(r), flush=True)
        if not points and not as_json:
            print(f"checkpoint-sidecar: no restore points in {store.description}", flush=True)
    except OSError as e:  # a closed pipe (history | head -1), a full disk
        return fail(f"cannot write the list: {e.strerror or type(e).__name__}")
    return EXIT_OK
