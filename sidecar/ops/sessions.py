"""``checkpoint-sidecar sessions [--json] [--live-within DURATION]``: every namespace of the store,
one line each, as the listing streams in (:func:`sidecar.ops.namespaces.walk`): namespace, owner,
files, bytes, last write (the store's clock), restore points, identity. Read-only. ``--json``: one
JSON object per line. Exit 0; 1 when the store cannot be read or is not there (the lines printed
so far stand). Every session's namespace below ``SIDECAR_PREFIX``, whatever
``FOUNDRY_AGENT_SESSION_ID`` says (:func:`sidecar.ops.namespaces.operator_prefix`)."""

from __future__ import annotations

import json
from typing import Any

from sidecar import log
from sidecar.config import Settings
from sidecar.errors import EXIT_OK
from sidecar.namespace import describe_identity
from sidecar.ops.namespaces import Namespace, full_name, start_operator, walk
from sidecar.storeclient import open_store, printing

HEADER = f"{'NAMESPACE':<44} {'OWNER':<8} {'FILES':>7} {'BYTES':>12} {'LAST WRITE (UTC)':<24} {'POINTS':>6}  IDENTITY"


def as_json(ns: Namespace, prefix: str) -> dict[str, Any]:
    """The ``--json`` object of one namespace."""
    g = ns.group
    last_write = log.rfc3339(g.last_write) if g.last_write is not None else None
    return {"namespace": full_name(prefix, g.namespace), "identity": ns.identity, "files": g.files,
            "objects": g.objects, "bytes": g.bytes, "last_write": last_write, "owner": ns.owner, "points": g.points}


def as_text(ns: Namespace, prefix: str) -> str:
    """The text line of one namespace (every name escaped: a key cannot forge a line)."""
    g = ns.group
    name = log.printable(full_name(prefix, g.namespace) or "(top of the store)")
    return (f"{name:<44} {ns.owner:<8} {g.files:>7} {g.bytes:>12} {log.rfc3339(g.last_write):<24} {g.points:>6}  "
            f"{log.printable(describe_identity(ns.identity))}")


async def command(settings: Settings, json_lines: bool, live_within: float) -> int:
    """Print every namespace (see the module docstring)."""
    started = start_operator(settings, "sessions")
    if isinstance(started, int):
        return started
    settings = started
    store = open_store(settings, read_only=True)
    prefix = settings.namespace.path

    async def body() -> None:
        if not json_lines:
            print(HEADER, flush=True)
        async for ns in walk(store, live_within):
            print(json.dumps(as_json(ns, prefix)) if json_lines else as_text(ns, prefix), flush=True)

    failed = await printing(store, body, f"cannot list the namespaces of {store.description}", "cannot write the list")
    return EXIT_OK if failed is None else failed
