"""``checkpoint-sidecar status``: what is in sync, pending upload, missing locally, or unseen.

Read-only: one listing of the namespace and one scan of each root, compared by
:func:`sidecar.plan.plan_status`. Exit 0 only when everything is in sync; directories the
sidecar cannot read and files no store can hold count as not in sync (they are not mirrored).
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import anyio.to_thread

from sidecar import log
from sidecar.config import Settings
from sidecar.errors import EXIT_FAIL, EXIT_OK, fail
from sidecar.listing import list_store
from sidecar.localfs import Gaps, scan_root
from sidecar.paths import Root
from sidecar.plan import plan_status
from sidecar.store.base import Store, StoreError
from sidecar.storeclient import missing, open_store

SHOWN = 10  # names listed per kind in the text report


async def command(settings: Settings, roots: list[Root], as_json: bool) -> int:
    """``checkpoint-sidecar status [--json]``: print the report (:func:`report`, :func:`render`).
    Exit 0 in sync; 1 when not, or when the store cannot be read or is not there (one error line then)."""
    store = open_store(settings, read_only=True)
    try:
        await store.open()
        if why := await missing(store):  # lists as empty without it: never "in sync" with nothing
            return fail(why)
        rep = await report(settings, roots, store)
    except StoreError as e:
        return fail(f"cannot reach the store: {e}")
    finally:
        await store.aclose()
    ns = settings.namespace
    try:
        print(json.dumps(rep, indent=2) if as_json else render(rep, ns.describe() if ns.path or ns.identity else ""),
              flush=True)
    except OSError as e:  # a closed pipe, a full disk
        return fail(f"cannot write the report: {e.strerror or type(e).__name__}")
    return EXIT_OK if rep["in_sync"] else EXIT_FAIL


async def report(settings: Settings, roots: list[Root], store: Store) -> dict[str, Any]:
    """The status report (the ``--json`` form). Raises StoreError when the store cannot be read."""
    await store.open()
    listing = await list_store(store, roots)
    ignore = settings.ignore_rules
    ns = settings.namespace
    out: dict[str, Any] = {"store": store.description, "prefix": ns.path, "identity": ns.identity,
                           "roots": {}, "in_sync": True}
    for root in roots:
        gaps = Gaps()
        local, _ = await anyio.to_thread.run_sync(scan_root, root, ignore, gaps)
        remote = {k: v for k, v in listing.objects.items() if k.split("/", 1)[0] == root.name}
        s = plan_status(local, remote, gaps)
        out["roots"][root.name] = {
            "path": root.path,
            "in_sync": len(s.in_sync),
            "pending_upload": s.pending_upload,
            "missing_locally": s.missing_locally,
            "unreadable": s.unreadable,
            "unstorable": s.unstorable,
        }
        out["in_sync"] &= s.ok
    if listing.unsafe:
        out["unsafe_stored_names"] = [k for k, _ in listing.unsafe]
    return out


def render(rep: dict[str, Any], namespace: str = "") -> str:
    """The text form: a line per root, then up to :data:`SHOWN` names of each kind, every name
    escaped (a file name cannot forge a line)."""
    lines = [f"store: {log.printable(rep['store'])}" + (f" (namespace {log.printable(namespace)})" if namespace else "")]
    for name, r in rep["roots"].items():
        counts = [f"{r['in_sync']} in sync", f"{len(r['pending_upload'])} pending upload",
                  f"{len(r['missing_locally'])} missing locally"]
        counts += [f"{len(r[k])} {k}" for k in ("unreadable", "unstorable") if r[k]]
        lines.append(f"{log.printable(name)} ({log.printable(r['path'])}): {', '.join(counts)}")
        for kind, label in (("pending_upload", "pending upload  "), ("missing_locally", "missing locally "),
                            ("unreadable", "unreadable dir  "), ("unstorable", "name too long   ")):
            lines += [f"  {label} {log.printable(k)}" for k in r[kind][:SHOWN]]
    lines.append("in sync" if rep["in_sync"] else "NOT in sync")
    return "\n".join(lines)


