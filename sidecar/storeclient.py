"""The store client for a command's settings: the one place the sidecar makes a store from
(:func:`sidecar.store.make_store` is called nowhere else)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from sidecar import log
from sidecar.errors import StoreConfigError

if TYPE_CHECKING:
    from sidecar.config import Settings
    from sidecar.paths import Root
    from sidecar.store.base import Store


def open_store(settings: Settings, read_only: bool = False, roots: list[Root] | None = None,
               writes: bool | None = None) -> Store:
    """The store client for ``settings``. ``read_only``: opening it creates nothing (no container,
    no directory); ``writes`` (default: not ``read_only``): False for a command that writes
    nothing at all, not even a probe of the store's clock (see :func:`sidecar.store.make_store`).
    Raises :class:`~sidecar.errors.StoreConfigError` when
    its URL or credentials cannot be used, or when on a container platform it is a directory that
    does not exist (:func:`check_store_volume`: checked before anything can make it; one on the
    container's own disk or on the filesystem of ``roots`` is a warning). Nothing is sent to the
    store yet."""
    from sidecar.store import make_store

    try:
        on_local_disk = check_store_volume(settings, roots or [])
        store = make_store(settings.store_url, settings.namespace.path, read_only=read_only,
                           concurrency=settings.concurrency, writes=writes)
    except ValueError as e:
        raise StoreConfigError(str(e)) from None
    for event, fields in on_local_disk:
        log.warning(event, None, **fields)
    return store


def check_store_volume(settings: Settings, roots: list[Root], cwd: str | None = None,
                       container_root: str = "/") -> list[tuple[str, dict[str, str]]]:
    """On a container platform (:attr:`~sidecar.config.Settings.platform`), the store's backend
    checks where its store is (``Location.check_volume``: a directory store must be a mounted
    volume): ValueError, one line, or warnings (an event and its fields). None off-platform,
    where a missing store is made when it is opened."""
    if settings.platform is None:
        return []
    return settings.store_url.location.check_volume(settings.platform, [r.path for r in roots], cwd or os.getcwd(),
                                                    container_root)


def store_at(settings: Settings, prefix: str, concurrency: int = 4) -> Store:
    """The store of ``settings`` at ``prefix`` (a full prefix, not below the namespace: another
    namespace, or the top of the store), read-only: opening it creates nothing (a container or
    store directory deleted meanwhile is never made again; what is gone lists as empty). Not
    opened; its URL was checked when the command's own store was made (:func:`open_store`)."""
    from sidecar.store import make_store

    return make_store(settings.store_url, prefix, read_only=True, concurrency=concurrency)


async def missing(store: Store) -> str | None:
    """The one error line for a store that is not there (:meth:`Store.exists`: the directory
    store's directory, the Azure container), None when it is: a read-only store lists as empty
    without it, and a typo in ``SIDECAR_STORE`` must never pass for a store with nothing in it.
    Raises ``StoreError`` when that cannot be told."""
    if await store.exists():
        return None
    return f"the store {store.description} is not there: check SIDECAR_STORE"
