"""Durable stores: one module per backend behind the interface in :mod:`sidecar.store.base`."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

from sidecar.store.base import NotFound, ObjectInfo, ObjectMeta, Store, StoreError, StoreFull, TransientStoreError

__all__ = [
    "NotFound", "ObjectInfo", "ObjectMeta", "Store", "StoreError", "StoreFull", "TransientStoreError",
    "store_kind", "make_store",
]


def store_kind(url: str) -> str:
    """``"directory"`` or ``"azure"`` for a ``SIDECAR_STORE`` value; ValueError otherwise."""
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("", "file"):
        return "directory"
    if scheme in ("http", "https"):
        return "azure"
    raise ValueError(f"unsupported store URL scheme {scheme!r}: use file:///dir, a path, or https://<account>.blob.core.windows.net/<container>")


def directory_of(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme.lower() == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file store URL must be file:///absolute/path, got host {parts.netloc!r}")
        return unquote(parts.path)
    return os.path.expanduser(url)


def make_store(url: str, prefix: str = "", read_only: bool = False) -> Store:
    """A store object for ``url`` (not yet opened); ``read_only``: opening it creates nothing."""
    kind = store_kind(url)
    if kind == "directory":
        from sidecar.store.directory import DirectoryStore

        return DirectoryStore(directory_of(url), prefix, create=not read_only)
    from sidecar.store.azure import AzureBlobStore

    return AzureBlobStore.from_url(url, prefix, create=not read_only)
