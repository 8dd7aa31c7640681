"""Durable stores: one module per backend behind the interface in :mod:`sidecar.store.base`,
chosen by the store URL's scheme in :mod:`sidecar.store.registry`."""

from __future__ import annotations

from sidecar.store.base import NotFound, ObjectInfo, ObjectMeta, Store, StoreError, StoreFull, TransientStoreError
from sidecar.store.registry import StoreURL, make_store, parse_store, store_kind

__all__ = [
    "NotFound", "ObjectInfo", "ObjectMeta", "Store", "StoreError", "StoreFull", "StoreURL", "TransientStoreError",
    "make_store", "parse_store", "store_kind",
]
