"""The owner marker, ``.sidecar/owner``: its fields (:class:`Marker`), its bounded read, the
stamp arithmetic, and the one compare-and-swap that writes it (:func:`swap`). No other module
writes or deletes the marker: the fence (:class:`sidecar.fence.Fence`), the start-up's take-over
and ``release``'s hand-over (:mod:`sidecar.takeover`) and ``prune`` (:mod:`sidecar.ops.pruner`) all
write through :func:`swap` and :func:`remove`. The rules the marker serves: :mod:`sidecar.fence`.

On the wire a marker is ``{"generation": stamp, "owner": id, "heartbeat": unix time or 0 once
released, "identity": {variable: value}}`` and, when known, ``"interval"`` (the owner's
``SIDECAR_HEARTBEAT_INTERVAL``), ``"window"`` and ``"margin"`` (its ``SIDECAR_FENCE_WINDOW`` and
``SIDECAR_FENCE_MARGIN``), the namespace's ``"lineage"`` id (:func:`marker_lineage`) and a
prune's ``"prune": {"phase": ...}``, stored with ``version =
stamp``. Every field but ``generation`` is optional: a marker written by an earlier release
parses. A stamp is the generation in its high bits and 32 random bits below (:func:`next_stamp`).

A proof of ownership (:class:`Proof`): a marker read that found ours counts for one window from
the moment the read was sent, on the prover's own monotonic clock."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from sidecar.store.base import (
    OWN_NAMESPACE,
    VERSION_COUNTER_BITS,
    NotFound,
    ObjectInfo,
    ObjectMeta,
    Store,
    sane_version,
)

OWNER_KEY = f"{OWN_NAMESPACE}/owner"

#: A prune marker's field: ``{"phase": PRUNE_PENDING or PRUNE_DELETING}`` (see :mod:`sidecar.ops.prune`).
PRUNE_FIELD = "prune"
PRUNE_PENDING, PRUNE_DELETING = "pending", "deleting"
#: A prune marker's ``owner`` begins with this; a starting sidecar's take-over marker with RESUMING.
PRUNE_OWNER, RESUMING = "prune:", "resuming:"
#: The ``owner`` a handed-over marker records (a sidecar's is a random hex id).
HANDED_OVER = "released"

#: The marker's field read_marker adds: the version the store holds the marker at (0: none).
STORED_VERSION = "_stored_version"
#: The field read_marker sets instead of the marker's own when it cannot read them: why.
UNREADABLE = "_unreadable"
#: A marker is a few hundred bytes; one larger than this is not one of ours and is not read.
MAX_MARKER_BYTES = 64 * 1024
#: Stamps above this are malformed (a generation in the high bits, 32 random bits below).
MAX_STAMP = 2**62  # so that the next stamp still fits a signed 64-bit mtime
#: The most seconds of a recorded write window (``window + margin``) a reader waits out: a
#: marker someone else wrote must not hold a prune for ever.
MAX_RECORDED_WAIT = 3600.0


def number(value: object, kind: type) -> float:
    """A marker field as a number; 0 when missing, malformed or out of range (a marker someone
    else wrote)."""
    try:
        n = kind(value or 0)
    except (TypeError, ValueError, OverflowError):
        return kind(0)
    if not 0 <= n <= MAX_STAMP:  # also NaN
        return kind(0)
    return n


def stamp_of(value: object) -> int:
    """A marker's ``generation`` field (a stamp); 0 when missing, malformed or out of range."""
    return int(number(value, int))


def held_stamp(fields: dict) -> int:
    """The stamp a marker (as :func:`read_marker` gives it) holds the namespace at: that of its
    ``generation`` or of the version the store keeps it at, whichever is higher (0: none)."""
    return max(stamp_of(fields.get("generation")), stamp_of(fields.get(STORED_VERSION)))


def marker_generation(marker: dict) -> int:
    """The generation an owner marker (as :func:`read_marker` gives it) holds the namespace at:
    that of :func:`held_stamp` (0: none)."""
    return held_stamp(marker) >> 32


def prune_phase(marker: dict) -> str | None:
    """The phase of a prune marker (:data:`PRUNE_PENDING`, :data:`PRUNE_DELETING`); None for
    any other marker."""
    value = marker.get(PRUNE_FIELD) if isinstance(marker, dict) else None
    phase = value.get("phase") if isinstance(value, dict) else None
    return phase if phase in (PRUNE_PENDING, PRUNE_DELETING) else None


def is_released(marker: dict) -> bool:
    """Whether an owner marker says its owner released the namespace (heartbeat 0)."""
    return isinstance(marker, dict) and "heartbeat" in marker and number(marker["heartbeat"], float) == 0


def marker_identity(marker: dict) -> dict[str, str]:
    """The identity an owner marker names; {} when none or malformed."""
    value = marker.get("identity") if isinstance(marker, dict) else None
    if not isinstance(value, dict) or len(value) > 16:
        return {}
    return {str(k)[:64]: str(v)[:128] for k, v in value.items()}


def marker_lineage(marker: dict) -> str | None:
    """The namespace's lineage id an owner marker carries (None: none, or malformed): a random id
    made at the namespace's first claim and carried by every marker written over it, so that a
    disk recorded under another id (filled against another store at the same place: a volume that
    was not mounted then) is never taken for this namespace's."""
    value = marker.get("lineage") if isinstance(marker, dict) else None
    return value if isinstance(value, str) and 0 < len(value) <= 64 and value.isalnum() and value.isascii() else None


def new_lineage() -> str:
    """A lineage id for a namespace's first claim (:func:`marker_lineage`)."""
    return secrets.token_hex(8)


def recorded_wait(marker: dict) -> float:
    """The write window (``window + margin``) an owner marker records, at most
    :data:`MAX_RECORDED_WAIT`; 0 when it records none (a marker of an earlier release)."""
    if not isinstance(marker, dict):
        return 0.0
    return min(number(marker.get("window"), float) + number(marker.get("margin"), float), MAX_RECORDED_WAIT)


def longer_window(marker: dict, window: float, margin: float) -> float:
    """The write window a claim or a prune over ``marker`` waits and records on: its own
    ``window``, or the owner's as the marker records it (:func:`recorded_wait` less ``margin``)
    when that is longer. A predecessor trusts each proof for its own window."""
    return max(window, recorded_wait(marker) - margin)


def carried_window(marker: dict) -> tuple[float | None, float | None]:
    """The ``window`` and ``margin`` a marker records (None: none recorded): a marker written over
    a held one (a take-over's, a hand-over's) carries them on, so that the next claim still waits
    out the owner's write window, not only its own."""
    if not isinstance(marker, dict) or not recorded_wait(marker):
        return None, None
    return number(marker.get("window"), float), number(marker.get("margin"), float)


@dataclass(frozen=True)
class Marker:
    """An owner marker to write. ``stamp`` is its ``generation`` on the wire; ``heartbeat`` a unix
    time, 0 once released; ``interval``, ``window``, ``margin`` (None: not recorded) and
    ``phase`` (a prune's, None: not a prune's) as the module docstring says. ``as_read``: the
    fields of a marker as read, written back unchanged instead (a prune cut short puts back
    what it replaced, whatever that held)."""

    stamp: int
    owner: str
    heartbeat: float
    identity: dict[str, str] = field(default_factory=dict)
    interval: float | None = None
    window: float | None = None
    margin: float | None = None
    phase: str | None = None
    as_read: dict | None = None
    lineage: str | None = None

    @classmethod
    def put_back(cls, fields: dict) -> "Marker":
        """The marker ``fields`` (as :func:`read_marker` gives them), to be written again as it was."""
        return cls(stamp_of(fields.get("generation")), str(fields.get("owner", "")), 0.0,
                   as_read={k: v for k, v in fields.items() if k != STORED_VERSION})

    def body(self) -> bytes:
        if self.as_read is not None:
            return json.dumps(self.as_read).encode()
        fields: dict = {"generation": self.stamp, "owner": self.owner, "heartbeat": self.heartbeat}
        if self.identity:
            fields["identity"] = dict(self.identity)
        for name in ("interval", "window", "margin"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.phase is not None:
            fields[PRUNE_FIELD] = {"phase": self.phase}
        if self.lineage is not None:
            fields["lineage"] = self.lineage
        return json.dumps(fields).encode()


async def swap(store: Store, marker: Marker, version: int, *, if_version: int | None = None,
               expected: ObjectInfo | None = None) -> ObjectInfo:
    """Write ``marker`` at ``version`` (its stamp, or above it): the store's supersede rule refuses
    it under a marker of a higher version, and with ``if_version`` unless the marker is still at
    that version (0: none). ``expected``: the marker as last read or written (``Store.put``). The
    marker as the store holds it afterwards: its version is ``version`` when this one landed."""
    data = marker.body()
    return await store.put(OWNER_KEY, data, ObjectMeta.of(data, version, 0o600, version=version),
                           if_version=if_version, expected=expected)


async def remove(store: Store, stamp: int) -> bool:
    """Delete the marker if the store still holds it at ``stamp``; whether it did."""
    return await store.delete_if(OWNER_KEY, stamp)


async def _marker_bytes(store: Store, key: str) -> tuple[bytes | None, ObjectInfo]:
    """The marker's bytes (None when larger than :data:`MAX_MARKER_BYTES`: never read whole) and
    the marker as the store holds it; :class:`NotFound` when there is none."""
    data = bytearray()
    async with await store.get_stream(key) as (info, chunks):
        if info.size <= MAX_MARKER_BYTES:
            async for chunk in chunks:
                data += chunk
                if len(data) > MAX_MARKER_BYTES:
                    break
    fits = info.size <= MAX_MARKER_BYTES and len(data) <= MAX_MARKER_BYTES
    return (bytes(data) if fits else None), info


async def read_marker(store: Store) -> dict:
    """The owner marker's fields, plus :data:`STORED_VERSION`; {} when there is none. A marker
    that cannot be read as one (larger than :data:`MAX_MARKER_BYTES`, not a JSON object, nested
    too deep) has no fields but its stored version and :data:`UNREADABLE`: whose namespace it is
    cannot be told, so no claim takes it over (:func:`sidecar.takeover.conflict`); ``release``
    rewrites it."""
    return (await read_marker_info(store))[0]


async def read_marker_info(store: Store, key: str = OWNER_KEY) -> tuple[dict, ObjectInfo | None]:
    """:func:`read_marker`'s fields and the marker as the store holds it (None: there is none),
    which the next write of the marker passes as ``expected`` (``Store.put``). ``key``: another
    namespace's marker, read through a store above it (``sessions``, ``prune``'s listing)."""
    try:
        data, info = await _marker_bytes(store, key)
    except NotFound:
        return {}, None
    value: object = None
    why = f"larger than {MAX_MARKER_BYTES // 1024} KiB"
    if data is not None:
        why = "not a JSON object"
        try:
            value = json.loads(data)
        except (ValueError, RecursionError):
            value = None
    if not isinstance(value, dict):
        return {STORED_VERSION: info.version, UNREADABLE: why}, info
    value[STORED_VERSION] = info.version
    return value, info


class Proof:
    """A proof of ownership on ``clock`` (monotonic; a test's fake one): a marker read that found
    ours, sent at ``sent``, proves ownership until ``sent + window``."""

    def __init__(self, window: float, clock: Callable[[], float] | None = None) -> None:
        self.window = window
        self.clock = clock if clock is not None else time.monotonic
        self.until = 0.0  # when the last proof expires (0: none yet)

    def fresh(self) -> bool:
        """Whether the last proof still holds."""
        return self.clock() < self.until

    def proved(self, sent: float) -> None:
        """A read (or a write of ours the store took) sent at ``sent`` found the marker ours."""
        self.until = sent + self.window

    def extended(self, sent: float) -> None:
        """As :meth:`proved`, never shortening a later proof (a heartbeat between proofs)."""
        self.until = max(self.until, sent + self.window)


def counted_version(version: int) -> int:
    """A stored version as it counts towards a claim's floor: itself, or 0 when its generation is
    above :data:`MAX_FLOOR_GENERATION` (no sidecar wrote it; a put replaces that object as if it
    had no version: ``store.base.supersedes``)."""
    return version if sane_version(version) else 0


def floor_stamp(floor: int) -> int:
    """A stamp whose next stamp (:func:`next_stamp`) has a generation above that of the stored
    version ``floor``, so that every version written under it is above ``floor``."""
    return (counted_version(floor) >> VERSION_COUNTER_BITS) << 32


async def stored_max_version(store: Store) -> int:
    """The highest counted version of any object stored in the namespace: one full listing (the
    start-up restore's listing gives it for free, ``Listing.max_version``)."""
    top = 0
    async for info in store.list():
        top = max(top, counted_version(info.version))
    return top


def next_stamp(current: int) -> int:
    """A stamp above ``current``: the next generation in the high bits, random low bits (never all
    ones, so a test can hold a stamp no claim of this generation can beat)."""
    return ((max(current, 0) >> 32) + 1) << 32 | secrets.randbelow(2**32 - 1)


def later_stamp(current: int) -> int:
    """A stamp above ``current`` in its generation (random low bits, never all ones) where there is
    room, else the next generation's: a swap that must change the marker's version without raising
    the generation the next claim goes above."""
    room = (2**32 - 2) - (current & (2**32 - 1))
    if current <= 0 or room <= 0:
        return next_stamp(current)
    return current + 1 + secrets.randbelow(room)
