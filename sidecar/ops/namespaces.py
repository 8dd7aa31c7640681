"""Every namespace of a store, streamed: one listing grouped by :class:`sidecar.ops.sessionplan.Grouper`,
each namespace's owner marker read (a few at a time, in order) and its owner told by the store's
clock. ``sessions`` prints them, ``prune`` prunes the ended ones. Memory is bounded by
:data:`BATCH` namespaces and the depth of a key, whatever the store holds. Both commands work
below :func:`operator_prefix` (never one session's namespace) and refuse a store that is not
there (:meth:`Store.exists`)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Mapping

import anyio

from sidecar import log
from sidecar.errors import EXIT_CONFIG, fail, first_of
from sidecar.marker import OWNER_KEY, STORED_VERSION, UNREADABLE, marker_identity, read_marker_info
from sidecar.namespace import SESSION_VAR, NamespaceError, references, resolve
from sidecar.ops.sessionplan import Group, Grouper, owner
from sidecar.paths import UnsafeKey, validate_relpath
from sidecar.store.base import Store, StoreError

if TYPE_CHECKING:
    from sidecar.config import Settings

#: Namespaces whose markers are read at once.
BATCH = 16


@dataclass
class Namespace:
    """One namespace: its totals, its marker's fields ({}: none), and its owner."""

    group: Group
    marker: dict
    owner: str
    now: float  # the store's time when the owner was told

    @property
    def identity(self) -> dict[str, str]:
        return marker_identity(self.marker)


def full_name(prefix: str, namespace: str) -> str:
    """A namespace as the sidecar names it (``SIDECAR_PREFIX`` included; a listing's are relative)."""
    return "/".join(p for p in (prefix, namespace) if p)


def operator_prefix(template: str, env: Mapping[str, str], session_namespace: str = "auto") -> tuple[str, bool]:
    """The prefix ``sessions`` and ``prune`` work below, and whether the session variable was
    ignored for it. Both are operator commands over every session, so the namespace a session's
    sidecar derives from ``FOUNDRY_AGENT_SESSION_ID`` (``<prefix>/<agent>/<session>``, or a
    template's expansion with ``/<session>``) never narrows them: the prefix is ``SIDECAR_PREFIX``
    resolved as if no session were named, cut before the segment that refers to the session id.
    Raises :class:`sidecar.namespace.NamespaceError`."""
    if not env.get(SESSION_VAR):
        return resolve(template, env, session_namespace).path, False
    segments = template.strip().strip("/").split("/")
    cut = next((i for i, seg in enumerate(segments) if SESSION_VAR in references(seg)), len(segments))
    without = {k: v for k, v in env.items() if k != SESSION_VAR}
    return resolve("/".join(segments[:cut]), without, session_namespace).path, True


def operator_settings(settings: "Settings", env: Mapping[str, str]) -> tuple["Settings", str | None]:
    """``settings`` for ``sessions`` and ``prune``: the namespace is :func:`operator_prefix`'s,
    with no identity. Also the one line that says the session variable was ignored (None when it
    was not set)."""
    from sidecar.namespace import Namespace as Resolved

    prefix, ignored = operator_prefix(settings.prefix, env, settings.session_namespace)
    wide = settings.model_copy()
    wide._namespace = Resolved(prefix)
    shown = log.printable(prefix) or "(top of the store)"
    note = (f"{SESSION_VAR} is set and ignored (this command covers every session): working below the prefix "
            f"{shown!r}") if ignored else None
    return wide, note


def start_operator(settings: "Settings", command: str, env: Mapping[str, str] | None = None) -> "Settings | int":
    """The start shared by ``sessions``, ``prune`` and ``verify``: :func:`operator_settings`, its
    note (if any) as one ``<command>: …`` line on stderr; or, for a prefix that cannot be used,
    the exit code once its one line is written."""
    try:
        wide, note = operator_settings(settings, os.environ if env is None else env)
    except NamespaceError as e:
        return fail(f"{e.variable}: {e}", EXIT_CONFIG)
    if note:
        print(f"{command}: {note}", file=sys.stderr, flush=True)
    return wide


class StoreClock:
    """The store's current time without a request each: :meth:`Store.now` once, then advanced by
    this machine's monotonic clock (an elapsed time, never a comparison of two clocks)."""

    def __init__(self, at: float) -> None:
        self._at, self._mono = at, time.monotonic()

    @classmethod
    async def of(cls, store: Store) -> "StoreClock":
        return cls(await store.now())

    def now(self) -> float:
        return self._at + (time.monotonic() - self._mono)


def unsafe_name(namespace: str) -> str | None:
    """Why a namespace's name (a directory someone made in a directory store, say) can be no
    sidecar's and no store request's (a backslash, NUL, ``..``): None when it can. Such a
    namespace is listed as of an unknown owner, never pruned, and never stops the others."""
    if not namespace:
        return None
    try:
        validate_relpath(namespace)
    except UnsafeKey as e:
        return str(e)
    return None


async def read_marker_at(store: Store, namespace: str) -> dict:
    """The owner marker of ``namespace`` (relative to ``store``'s prefix), read through the top
    store (bytes and time only: :data:`STORED_VERSION` is not trusted there); {} when absent; for
    a namespace whose name is unsafe (:func:`unsafe_name`), unreadable."""
    if why := unsafe_name(namespace):
        return {UNREADABLE: f"its name is no namespace's ({why})"}
    fields, _ = await read_marker_info(store, f"{namespace}/{OWNER_KEY}" if namespace else OWNER_KEY)
    fields.pop(STORED_VERSION, None)
    return fields


async def walk(store: Store, live_within: float, clock: StoreClock | None = None) -> AsyncIterator[Namespace]:
    """Every namespace below ``store``'s prefix, as the listing leaves it (children before their
    parents, the top last). Raises ``StoreError``."""
    clock = clock or await StoreClock.of(store)
    batch: list[Group] = []

    async def told(groups: list[Group]) -> list[Namespace]:
        markers: list[dict] = [{} for _ in groups]

        async def read(i: int) -> None:
            if groups[i].marker is not None:
                markers[i] = await read_marker_at(store, groups[i].namespace)

        with first_of(StoreError):  # the walk's failure, not a group of them
            async with anyio.create_task_group() as tg:
                for i in range(len(groups)):
                    tg.start_soon(read, i)
        now = clock.now()
        return [Namespace(g, m, owner(m, g.marker.modified if g.marker else None, now, live_within), now)
                for g, m in zip(groups, markers, strict=True)]

    async for group in groups(store):
        batch.append(group)
        if len(batch) >= BATCH:
            for ns in await told(batch):
                yield ns
            batch = []
    for ns in await told(batch):
        yield ns


async def groups(store: Store) -> AsyncIterator[Group]:
    """The namespaces below ``store``'s prefix as one streamed listing leaves them (children before
    their parents, the top last): their totals only, no marker read, no clock asked (``verify``
    reads no more). Raises ``StoreError``."""
    grouper = Grouper()
    async for info in store.list():
        for group in grouper.add(info):
            yield group
    for group in grouper.finish():
        yield group


def namespace_store(settings: "Settings", prefix: str, namespace: str, concurrency: int = 4) -> Store:
    """A namespace's own store, as its sidecar makes it (the directory store's records and locks
    are per namespace), read-only (:func:`~sidecar.storeclient.store_at`). Not opened."""
    from sidecar.storeclient import store_at

    return store_at(settings, full_name(prefix, namespace), concurrency)
