"""Who may take a namespace over: a sidecar of the owner's identity (:func:`conflict`,
:func:`check_identity`), a starting sidecar before its restore (:func:`take_for_restore`: its side
of pruning), ``release`` handing the namespace over to any identity (:func:`hand_over`). The
rules: :mod:`sidecar.fence`; the marker itself: :mod:`sidecar.marker`."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import anyio

from sidecar import log
from sidecar.marker import (
    HANDED_OVER,
    OWNER_KEY,
    PRUNE_DELETING,
    PRUNE_PENDING,
    RESUMING,
    STORED_VERSION,
    UNREADABLE,
    Marker,
    carried_window,
    floor_stamp,
    held_stamp,
    is_released,
    later_stamp,
    marker_generation,
    marker_identity,
    marker_lineage,
    next_stamp,
    prune_phase,
    read_marker,
    read_marker_info,
    stored_max_version,
    swap,
)
from sidecar.namespace import command_for, describe_identity, variables_for
from sidecar.store.base import Store, StoreError

#: How long a starting sidecar waits for a prune deleting its namespace to end (then: exit 1).
PRUNE_WAIT_SECONDS = 300.0


class IdentityConflict(Exception):
    """The namespace belongs to another compute identity (one line: both identities, the fix)."""


def conflict(marker: dict, identity: dict[str, str], namespace: str, store_url: str = "") -> str | None:
    """Why a sidecar of ``identity`` must not use the namespace whose owner marker is ``marker``;
    None when it may (the same identity, or a marker that records none). A sidecar without an
    identity never takes a namespace whose marker records one, and none takes one whose marker
    it cannot read (it may record another identity). ``store_url`` (``SIDECAR_STORE``): the
    store the hints' commands name (:func:`sidecar.namespace.command_for`)."""
    where = namespace or "(top of the store)"
    release = command_for("release", store_url, namespace)
    if isinstance(marker, dict) and marker.get(UNREADABLE):
        key = f"{namespace}/{OWNER_KEY}" if namespace else OWNER_KEY
        return (f"the owner marker {key!r} of the store namespace {where!r} cannot be read ({marker[UNREADABLE]}): "
                "whose namespace it is cannot be told, so this sidecar does not take it over. Look at it; if "
                f"no other session owns the namespace, hand it over (this rewrites the marker): {release}")
    theirs = marker_identity(marker)
    if not theirs or theirs == identity:
        return None
    if not identity:
        return (f"the store namespace {where!r} belongs to {describe_identity(theirs)}, and this sidecar has no "
                "identity (no session id, and SIDECAR_PREFIX refers to no variable): it must not take over a "
                "session's namespace. Run it with that identity, with these variables: "
                f"{variables_for(store_url, namespace, theirs)}; "
                "or, once that session has ended (release refuses a live one), hand the namespace over to any "
                f"identity: {release}. Reading it needs neither: restore --as-of into empty roots, history, status")
    return (f"the store namespace {where!r} belongs to {describe_identity(theirs)}, "
            f"and this sidecar is {describe_identity(identity)}: two sessions must not share a namespace. "
            "Give each its own: leave SIDECAR_PREFIX without variables and SIDECAR_SESSION_NAMESPACE=auto "
            "(one namespace per FOUNDRY_AGENT_SESSION_ID), or refer to a per-compute variable such as "
            "{POD_NAME} in SIDECAR_PREFIX")


async def check_identity(store: Store, identity: dict[str, str], namespace: str, store_url: str = "") -> int:
    """Raise :class:`IdentityConflict` when the namespace's owner is of another identity (or this
    sidecar has none and the owner has one); else the marker's generation (:func:`marker_generation`).
    One read."""
    marker = await read_marker(store)
    why = conflict(marker, identity, namespace, store_url)
    if why:
        raise IdentityConflict(why)
    return marker_generation(marker)


@dataclass(frozen=True)
class Taken:
    """What :func:`take_for_restore` found and did."""

    generation: int  # the marker's generation as found (:func:`marker_generation`; 0: none)
    stamp: int = 0  # the stamp of the marker this sidecar wrote over it (0: none written)
    released: bool = True  # what it replaced was released or absent: the claim need not wait
    pruned: bool = False  # a prune deleted the namespace meanwhile: it starts empty
    marker: bool = False  # a marker was there when the restore began
    prune: bool = False  # what it replaced was a prune's pending marker (a prune cut short, or killed)
    #: the namespace's lineage id the marker found carries (:func:`marker_lineage`; "": a marker
    #: without one, None: no marker)
    lineage: str | None = None


async def take_for_restore(store: Store, identity: dict[str, str], namespace: str, *, take: bool = True,
                           wait: float = PRUNE_WAIT_SECONDS, poll: float = 0.5, store_url: str = "",
                           check: bool = True) -> Taken:
    """:func:`check_identity` for a sidecar about to restore, and its side of pruning. A prune
    marker in phase ``deleting`` is waited for (polled, at most ``wait`` seconds: then a
    :class:`StoreError`) until it is gone, and the namespace starts empty (one line says so).
    With ``take`` (``sync``, ``run``), a ``pending`` prune marker or a released one is replaced at
    once by ours (a higher stamp of the same generation, a fresh heartbeat: live to ``prune``), a compare-and-swap, so
    that no prune can delete what the restore is reading: prune's own swap then fails.
    ``check`` False (``take`` False only: a read that writes nothing to the store, ``restore
    --as-of`` into empty roots): the identity is not checked. ``store_url``: for the hints."""
    if take and not check:
        raise ValueError("a sidecar that takes the namespace over checks its identity")
    deadline = time.monotonic() + wait
    where = namespace or "(top of the store)"
    pruned = False
    while True:
        marker, info = await read_marker_info(store)
        why = conflict(marker, identity, namespace, store_url) if check else None
        if why:
            raise IdentityConflict(why)
        phase = prune_phase(marker)
        if phase == PRUNE_DELETING:
            if time.monotonic() >= deadline:
                finish = command_for("prune --older-than 7d", store_url, namespace)
                raise StoreError(f"the store namespace {where!r} has been being pruned for {wait:.0f} s and the prune "
                                 f"has not ended (its marker {OWNER_KEY!r} says deleting): if no prune runs any more, "
                                 f"finish it (a dead prune's namespace is finished at once, whatever --older-than "
                                 f"says): {finish}; then start again")
            if not pruned:
                log.warning("namespace_being_pruned", namespace=log.printable(where),
                            detail="a prune is deleting this namespace (its session had ended): waiting for it to end")
            pruned = True
            await anyio.sleep(poll)
            continue
        if pruned:
            log.warning("namespace_pruned", namespace=log.printable(where),
                        detail=f"namespace {log.printable(where)} was pruned after its session ended: starting empty")
        released = not marker or is_released(marker)
        # "" for a marker without a lineage id (an earlier release's): a record under an id is not its
        found = Taken(marker_generation(marker), 0, released, pruned, bool(marker),
                      lineage=(marker_lineage(marker) or "") if marker else None)
        if not take or not (phase == PRUNE_PENDING or (marker and released)):
            return found
        seen = marker.get(STORED_VERSION, 0)
        stamp = later_stamp(held_stamp(marker))
        window, margin = carried_window(marker)
        ours = Marker(stamp, RESUMING + uuid.uuid4().hex, time.time(), dict(identity), window=window, margin=margin,
                      lineage=marker_lineage(marker))
        if (await swap(store, ours, stamp, if_version=seen, expected=info)).version == stamp:
            if phase == PRUNE_PENDING:
                log.info("prune_cancelled", namespace=log.printable(where),
                         detail="a prune was about to delete this namespace: taken over, every object kept")
            # a prune's pending marker hid whether the owner before it had released: wait as if not
            return Taken(found.generation, stamp, released and phase is None, pruned, True, phase == PRUNE_PENDING,
                         found.lineage)
        # changed since it was read (a prune's next phase, another claim): read it again


@dataclass(frozen=True)
class Handover:
    """What :func:`hand_over` freed."""

    identity: dict[str, str]  # the owner's, as its marker recorded it ({}: none)
    generation: int  # the generation the namespace is now held at
    held: bool  # the owner had not released it: the next claim waits out its write window


async def hand_over(store: Store, attempts: int = 5) -> Handover | None:
    """Free the namespace for a sidecar of any identity (``checkpoint-sidecar release``): the
    marker is rewritten without an identity, at a higher stamp, so that an owner still running is
    fenced at its next proof. Its heartbeat stays non-zero unless the owner had released the
    namespace, so the next claim still waits out that owner's write window. None when there is no
    marker: nothing to hand over. A compare-and-swap on the marker as read, tried again when a
    claim lands in between. Like a claim, the stamp is above every version stored in the
    namespace (one listing), not only above the marker's: a rolled-back or copied marker must not
    leave the handed-over generation below a live owner's."""
    floor = floor_stamp(await stored_max_version(store))
    for _ in range(attempts):
        current, marker = await read_marker_info(store)
        if not current:
            return None
        seen = current.get(STORED_VERSION, 0)  # as stored: the swap compares it, even out of range
        stamp = next_stamp(max(held_stamp(current), floor))
        held = not is_released(current)
        window, margin = carried_window(current)
        ours = Marker(stamp, HANDED_OVER, time.time() if held else 0, window=window, margin=margin,
                      lineage=marker_lineage(current))
        if (await swap(store, ours, stamp, if_version=seen, expected=marker)).version == stamp:
            return Handover(marker_identity(current), stamp >> 32, held)
    raise StoreError("the owner marker changed at every attempt (a sidecar keeps claiming this namespace): "
                     "stop it, then release again")

