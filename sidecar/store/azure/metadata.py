"""An object's facts on an Azure blob: the metadata the sidecar writes on each blob
(:func:`blob_metadata`), and the :class:`~sidecar.store.base.ObjectInfo` read back from a blob's
properties or a listing's entry (:func:`object_info`, :func:`listed`), a blob another tool wrote
included. No SDK, no request.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime
from typing import Any, Mapping

from sidecar.store.base import ObjectInfo, ObjectMeta

# Metadata names must be valid C# identifiers; Azure treats them case-insensitively.
META_SHA256 = "sidecar_sha256"
META_MTIME = "sidecar_mtime_ns"
META_MODE = "sidecar_mode"
META_VERSION = "sidecar_version"

#: Mode reported for blobs that carry no sidecar metadata (written by something else).
FOREIGN_MODE = 0o600

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def blob_metadata(meta: ObjectMeta) -> dict[str, str]:
    """The metadata written on the blob of an object with ``meta``."""
    return {META_SHA256: meta.sha256, META_MTIME: str(meta.mtime_ns), META_MODE: format(meta.mode & 0o7777, "o"),
            META_VERSION: str(meta.version)}


def quoted_etag(etag: str | None) -> str | None:
    """ETags as the service sends them in headers (quoted); listings give them bare."""
    if not etag:
        return None
    return etag if etag.startswith(('"', 'W/"')) else f'"{etag}"'


def _version(value: str | None) -> int:
    """A blob's ``sidecar_version``; 0 when missing or malformed (written by something else)."""
    try:
        number = int(value or 0)
    except (TypeError, ValueError):
        return 0
    return number if 0 <= number < 2**63 else 0


def _http_date_ns(value: datetime | None) -> int:
    """Nanoseconds since the epoch of a ``Last-Modified``; 0 when absent."""
    return int(value.timestamp() * 1_000_000_000) if value is not None else 0


def object_info(key: str, size: int, metadata: Mapping[str, str] | None, etag: str | None,
                last_modified: datetime | None) -> ObjectInfo:
    """The :class:`ObjectInfo` of a blob from its properties: our metadata read back (names in any
    case), or, for a blob without it (another tool's), no digest, its ``Last-Modified`` and
    :data:`FOREIGN_MODE`."""
    md = {k.lower(): v for k, v in (metadata or {}).items()}
    etag = quoted_etag(etag)
    version = _version(md.get(META_VERSION))
    modified = last_modified.timestamp() if last_modified is not None else None
    try:
        sha = md[META_SHA256]
        if _SHA256_RE.match(sha):
            mtime = int(md[META_MTIME])
            return ObjectInfo(key, size, sha, mtime if 0 <= mtime < 2**63 else 0, int(md[META_MODE], 8) & 0o7777,
                              etag, version, modified)
    except (KeyError, ValueError, TypeError):
        pass
    return ObjectInfo(key, size, None, _http_date_ns(last_modified), FOREIGN_MODE, etag, version, modified)


def listed(props: Any, start: str, cut: int) -> ObjectInfo | None:
    """A listing's entry (names from ``start``, the store's prefix ``cut`` off) as an :class:`ObjectInfo`;
    None for what is no object: a name outside ``start``, a hierarchical account's folder."""
    name = props.name
    if not name.startswith(start) or name.endswith("/"):
        return None  # directory placeholders (hierarchical namespace accounts)
    md = props.metadata or {}
    if str(md.get("hdi_isfolder", "")).lower() == "true":
        return None
    info = object_info(name[cut:], props.size, md, props.etag, props.last_modified)
    lease = getattr(props, "lease", None)
    if lease is not None and str(getattr(lease, "status", "")).lower() == "locked":
        return dataclasses.replace(info, leased=True)
    return info
