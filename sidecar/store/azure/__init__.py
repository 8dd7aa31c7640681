"""The Azure Blob backend (see :mod:`sidecar.store.registry` for what a backend provides).

    location.py     the store URL (host or path style), parsed once; no SDK
    credentials.py  which credential signs the requests, first match wins
    errors.py       an SDK failure as one line: StoreError, TransientStoreError or NotFound
    retry.py        the SDK's retry policy on the sidecar's schedule
    metadata.py     an object's facts on a blob: the metadata written, ObjectInfo read back; no SDK
    upload.py       one conditional upload: Put Blob, or staged blocks and a Put Block List
    store.py        AzureBlobStore: the store rules (conditional writes, Content-MD5, listing)

Only ``store.py`` and what it imports load the SDK; the URL check (:func:`parse_url`) does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from sidecar.store.azure.location import BlobLocation, parse_store_url, parse_url

if TYPE_CHECKING:
    from sidecar.store.azure.store import AzureBlobStore

__all__ = ["AzureBlobStore", "BlobLocation", "make", "parse_store_url", "parse_url"]


def make(location: BlobLocation, prefix: str, *, create: bool, concurrency: int,
         env: Mapping[str, str], writes: bool | None = None) -> "AzureBlobStore":
    """The registry's factory: the store at ``location`` with ``prefix`` (the namespace) below
    the URL's own, credentials from ``env``, a pool sized for ``concurrency`` operations
    (``writes`` is not needed: the service's clock is read from a response, writing nothing)."""
    from sidecar.store.azure.store import AzureBlobStore

    return AzureBlobStore.at(location.with_prefix(prefix), env, create=create, concurrency=concurrency)


def __getattr__(name: str) -> Any:
    if name == "AzureBlobStore":  # the SDK is imported with the store, not with the URL check
        from sidecar.store.azure.store import AzureBlobStore

        return AzureBlobStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
