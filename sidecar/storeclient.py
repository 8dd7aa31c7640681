"""The store client for a command's settings: the one place the sidecar makes a store from
(:func:`sidecar.store.make_store` is called nowhere else); and what a command says when the store
is not where it looks (:func:`missing`, :func:`say_if_missing`; :func:`printing` for a read-only
command's errors), or holds, elsewhere than this
namespace, state an older release kept (:func:`report_legacy_state`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Awaitable, Callable

from sidecar import log
from sidecar.errors import StoreConfigError, fail

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


async def printing(store: Store, body: Callable[[], Awaitable[None]], cannot_read: str, cannot_write: str,
                   opening: Callable[[], Awaitable[None]] | None = None) -> int | None:
    """Run a read-only command's ``body`` (it prints as it reads) on ``store``: opened here (by
    ``opening``, when it retries), told :func:`missing`, closed afterwards. None once done; else
    the exit code of one line: ``cannot_read`` and the store's error, or ``cannot_write`` and why
    the output failed (a closed pipe, a full disk)."""
    from sidecar.store.base import StoreError

    try:
        await (opening or store.open)()
        if why := await missing(store):
            return fail(why)
        await body()
    except StoreError as e:
        return fail(f"{cannot_read}: {e}")
    except OSError as e:
        return fail(f"{cannot_write}: {e.strerror or type(e).__name__}")
    finally:
        await store.aclose()
    return None


async def say_if_missing(store: Store) -> None:
    """A plain ``restore`` that found nothing: when the store itself is not there, one warning line
    naming it. Not an error: an init container's restore on a new deployment runs before the first
    ``sync`` or ``run`` creates the store (the Azure container; a directory store on a container
    platform is refused before this, exit 2), so it starts empty; a typo in ``SIDECAR_STORE`` is
    said all the same."""
    from sidecar.store.base import StoreError

    try:
        there = await store.exists()
    except StoreError as e:
        log.debug("store_exists_check_failed", error=str(e))
        return
    if not there:
        log.warning("store_not_there", store=store.description,
                    detail="the store does not exist yet: nothing was restored and nothing was created; the first "
                           "sync or run creates it. Check SIDECAR_STORE unless this is a first start")


async def report_legacy_state(settings: Settings, roots: list[Root], namespace_empty: bool | None) -> None:
    """After the restore step: when this compute's namespace (``namespace_empty``, as the restore
    listed it) and its roots are empty, look once where a release without namespaces kept the
    state (the top of ``SIDECAR_PREFIX``) and say how to adopt what is there: state must not be
    abandoned silently by an upgrade. Reads a store of its own, read-only. Never fails."""
    import anyio.to_thread

    from sidecar.localfs import has_regular_files
    from sidecar.paths import LINEAGE_FILE
    from sidecar.store.base import StoreError

    ns = settings.namespace
    if ns.legacy is None or not namespace_empty:
        return
    empty = [r for r in roots if not await anyio.to_thread.run_sync(has_regular_files, r.path, settings.ignore_rules)]
    if not empty:
        return  # the host has its state (being adopted into this namespace, say)

    found: list[str] = []
    try:
        legacy = store_at(settings, ns.legacy, concurrency=settings.concurrency)  # only looked at
    except ValueError:
        return
    try:
        await legacy.open()
        for root in empty:
            async for _info in legacy.list(root.name + "/"):
                found.append(root.name)
                break
    except StoreError as e:
        log.debug("legacy_state_check_failed", error=str(e))
    finally:
        with anyio.CancelScope(shield=True):
            await legacy.aclose()
    if found and ns.project:
        import shlex

        log.warning(
            "legacy_state_found", at="the top of the store", roots=",".join(found), namespace=ns.path,
            detail=(f"the default store is shared by every project on this machine, and keeps each in a namespace "
                    f"of its own; state stored before that is at its top, and this project's namespace {ns.path} "
                    f"({ns.project}) is empty. If that state is this project's, restore it once explicitly, naming "
                    f"the store: SIDECAR_STORE={shlex.quote(str(settings.store))} checkpoint-sidecar restore; "
                    "run or sync then mirrors it into this namespace (docs/NAMESPACES.md)"))
    elif found:
        where = ns.legacy or "the top of the store"
        log.warning(
            "legacy_state_found", at=where, roots=",".join(found), namespace=ns.path,
            detail=(f"state stored without a session namespace is at {where}, and this compute's namespace "
                    f"{ns.path} is empty. If that state is this session's, restore it once explicitly: "
                    f"SIDECAR_PREFIX='{ns.legacy}' SIDECAR_SESSION_NAMESPACE=off checkpoint-sidecar restore; "
                    f"then remove the record naming the old place (rm {' '.join(n + '/' + LINEAGE_FILE for n in found)}: "
                    "a root another namespace recorded is refused); sync then mirrors it into this namespace "
                    "(docs/NAMESPACES.md)"))
