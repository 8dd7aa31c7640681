"""Fencing: when a new compute's sidecar starts while an old one is still draining, the old one must
never overwrite or delete the new one's files.

The store holds an owner marker, ``.sidecar/owner``: ``{"generation": stamp, "owner": id,
"heartbeat": unix time or 0 once released, "identity": {variable: value}}``, written with
``version = stamp`` so the store's supersede rule refuses a marker with a lower stamp (the
heartbeat is for people: no decision reads its time). A stamp is the generation in its high bits and 32 random bits
below (:func:`next_stamp`): two sidecars that claim the same generation at the same moment never
hold the same stamp, so the store keeps exactly one of them and the other is fenced at its next
proof (within ``window`` seconds; before any write when its claim is the one refused). A marker of
an older version (``generation`` a plain small number) is below every stamp, and an older version
reading a stamp claims ``stamp + 1``, which is above it. Protocol:

* **claim** (start-up, once the restore is done, beside the first reconcile): read the marker, write
  the next stamp. No write of ours happens before it. If the previous owner has
  not released the namespace (heartbeat not 0: still draining, or gone without a word), wait one write window
  plus the margin before the first write of ours, on our own monotonic clock: no timestamp of
  another machine is ever compared with ours (reads, restore, the host's start and readiness
  are not delayed, only our uploads).
* **before writing**, at most once per ``window`` seconds: re-write the marker with our generation
  and a fresh heartbeat. If the store refuses it (a higher generation is there), we are fenced:
  nothing more is written, and the work stays pending for the operator to see.

* **versions**: a claim's generation is above every version already stored in the namespace
  (``floor``: the highest, from the start-up listing), not only above the marker's: a lost,
  rolled-back or copied marker, or objects copied in from another namespace, never leave this
  sidecar's writes older than what is stored.

* **identity**: the marker names the compute identity that owns the namespace (the session id, or
  the values ``SIDECAR_PREFIX`` refers to; see :mod:`sidecar.namespace`). A sidecar of another
  identity, or of none, is refused before it restores (:func:`check_identity`) and, should two
  start at once on an empty namespace, at its claim or its next proof: it never fences the
  owner's successors. A marker without an identity (written by an older release, with a fixed
  prefix, or by :func:`hand_over`) is taken over by anyone; one that cannot be read (garbled,
  too large) by no one: ``release`` rewrites it.

A writer thus writes only within ``window`` seconds of proving it still owns the prefix, and a new
owner waits ``window + margin`` after its claim before writing: time-based fencing as in lease
protocols, correct while the two machines' clocks run at about the same rate (a stall longer than
``margin`` inside one write is the limit), whatever time they show.
One marker write per window while uploading; none while idle.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import anyio

from sidecar import log
from sidecar.namespace import describe_identity
from sidecar.store.base import (  # noqa: F401 (the version constants are part of this module's interface)
    MAX_FLOOR_GENERATION,
    OWN_NAMESPACE,
    VERSION_COUNTER_BITS,
    NotFound,
    ObjectMeta,
    Store,
    StoreError,
    sane_version,
)

OWNER_KEY = f"{OWN_NAMESPACE}/owner"




class Fenced(Exception):
    """A newer sidecar owns this store prefix."""


class IdentityConflict(Exception):
    """The namespace belongs to another compute identity (one line: both identities, the fix)."""


def conflict(marker: dict, identity: dict[str, str], namespace: str) -> str | None:
    """Why a sidecar of ``identity`` must not use the namespace whose owner marker is ``marker``;
    None when it may (the same identity, or a marker that records none). A sidecar without an
    identity never takes a namespace whose marker records one, and none takes one whose marker
    it cannot read (it may record another identity)."""
    where = namespace or "(top of the store)"
    if isinstance(marker, dict) and marker.get(UNREADABLE):
        key = f"{namespace}/{OWNER_KEY}" if namespace else OWNER_KEY
        return (f"the owner marker {key!r} of the store namespace {where!r} cannot be read ({marker[UNREADABLE]}): "
                "whose namespace it is cannot be told, so this sidecar does not take it over. Look at it; if "
                "no other session owns the namespace, hand it over (this rewrites the marker): "
                f"SIDECAR_PREFIX={namespace!r} SIDECAR_SESSION_NAMESPACE=off checkpoint-sidecar release")
    theirs = marker_identity(marker)
    if not theirs or theirs == identity:
        return None
    if not identity:
        return (f"the store namespace {where!r} belongs to {describe_identity(theirs)}, and this sidecar has no "
                "identity (no session id, and SIDECAR_PREFIX refers to no variable): it must not take over a "
                "session's namespace. Run it with the session's identity, or hand the namespace over first: "
                f"SIDECAR_PREFIX={namespace!r} SIDECAR_SESSION_NAMESPACE=off checkpoint-sidecar release")
    return (f"the store namespace {where!r} belongs to {describe_identity(theirs)}, "
            f"and this sidecar is {describe_identity(identity)}: two sessions must not share a namespace. "
            "Give each its own: leave SIDECAR_PREFIX without variables and SIDECAR_SESSION_NAMESPACE=auto "
            "(one namespace per FOUNDRY_AGENT_SESSION_ID), or refer to a per-compute variable such as "
            "{POD_NAME} in SIDECAR_PREFIX")


def marker_identity(marker: dict) -> dict[str, str]:
    """The identity an owner marker names; {} when none or malformed."""
    value = marker.get("identity") if isinstance(marker, dict) else None
    if not isinstance(value, dict) or len(value) > 16:
        return {}
    return {str(k)[:64]: str(v)[:128] for k, v in value.items()}


#: The marker's field read_marker adds: the version the store holds the marker at (0: none).
STORED_VERSION = "_stored_version"
#: The field read_marker sets instead of the marker's own when it cannot read them: why.
UNREADABLE = "_unreadable"
#: A marker is a few hundred bytes; one larger than this is not one of ours and is not read.
MAX_MARKER_BYTES = 64 * 1024


async def _marker_bytes(store: Store) -> tuple[bytes | None, int]:
    """The marker's bytes (None when larger than :data:`MAX_MARKER_BYTES`: never read whole) and
    the version the store holds it at; :class:`NotFound` when there is none."""
    info, chunks = await store.get_stream(OWNER_KEY)
    data = bytearray()
    try:
        if info.size <= MAX_MARKER_BYTES:
            async for chunk in chunks:
                data += chunk
                if len(data) > MAX_MARKER_BYTES:
                    break
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
    fits = info.size <= MAX_MARKER_BYTES and len(data) <= MAX_MARKER_BYTES
    return (bytes(data) if fits else None), info.version


async def read_marker(store: Store) -> dict:
    """The owner marker's fields, plus :data:`STORED_VERSION`; {} when there is none. A marker
    that cannot be read as one (larger than :data:`MAX_MARKER_BYTES`, not a JSON object, nested
    too deep) has no fields but its stored version and :data:`UNREADABLE`: whose namespace it is
    cannot be told, so no claim takes it over (:func:`conflict`); ``release`` rewrites it."""
    try:
        data, version = await _marker_bytes(store)
    except NotFound:
        return {}
    value: object = None
    why = f"larger than {MAX_MARKER_BYTES // 1024} KiB"
    if data is not None:
        why = "not a JSON object"
        try:
            value = json.loads(data)
        except (ValueError, RecursionError):
            value = None
    if not isinstance(value, dict):
        return {STORED_VERSION: version, UNREADABLE: why}
    value[STORED_VERSION] = version
    return value


async def check_identity(store: Store, identity: dict[str, str], namespace: str) -> None:
    """Raise :class:`IdentityConflict` when the namespace's owner is of another identity (or this
    sidecar has none and the owner has one). One read."""
    why = conflict(await read_marker(store), identity, namespace)
    if why:
        raise IdentityConflict(why)


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


@dataclass(frozen=True)
class Handover:
    """What :func:`hand_over` freed."""

    identity: dict[str, str]  # the owner's, as its marker recorded it ({}: none)
    generation: int  # the generation the namespace is now held at
    held: bool  # the owner had not released it: the next claim waits out its write window


#: The ``owner`` a handed-over marker records (a sidecar's is a random hex id).
HANDED_OVER = "released"


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
        current = await read_marker(store)
        if not current:
            return None
        seen = current.get(STORED_VERSION, 0)  # as stored: the swap compares it, even out of range
        stamp = next_stamp(max(_stamp(current.get("generation")), _stamp(seen), floor))
        held = not ("heartbeat" in current and _number(current["heartbeat"], float) == 0)
        body = json.dumps({"generation": stamp, "owner": HANDED_OVER, "heartbeat": time.time() if held else 0}).encode()
        info = await store.put(OWNER_KEY, body, ObjectMeta.of(body, stamp, 0o600, version=stamp), if_version=seen)
        if info.version == stamp:
            return Handover(marker_identity(current), stamp >> 32, held)
    raise StoreError("the owner marker changed at every attempt (a sidecar keeps claiming this namespace): "
                     "stop it, then release again")


class Fence:
    def __init__(self, store: Store, window: float = 2.0, margin: float = 8.0,
                 identity: dict[str, str] | None = None, namespace: str = "",
                 on_wait: Callable[[float | None], None] | None = None, floor: int | None = None) -> None:
        self.store = store
        #: the highest version stored in the namespace, the claim's generation goes above it
        #: (None: not known, listed at the claim)
        self.floor = floor
        self.on_wait = on_wait  # told the monotonic time our writes may begin (None: at once)
        self.identity = dict(identity or {})
        self.namespace = namespace
        self.window = window
        self.margin = margin
        self.owner = uuid.uuid4().hex
        self.stamp = 0  # ours once claimed: see next_stamp
        self.writable_at = 0.0  # monotonic time before which we do not write
        self.valid_until = 0.0  # monotonic time our last proof of ownership expires
        self.fenced: str | None = None
        self._writes = 0
        self._lock = anyio.Lock()
        self._claimed = anyio.Event()  # set when claim() has ended, claimed or fenced

    async def _read(self) -> dict:
        return await read_marker(self.store)

    def _body(self, stamp: int, heartbeat: float) -> bytes:
        marker: dict = {"generation": stamp, "owner": self.owner, "heartbeat": heartbeat}
        if self.identity:
            marker["identity"] = self.identity
        return json.dumps(marker).encode()

    @property
    def generation(self) -> int:
        return self.stamp >> 32

    def next_version(self) -> int:
        """The version for this sidecar's next write of a key (``ObjectMeta.version``): above every
        version a previous owner wrote (its generation is lower), rising with each write. 0 before
        the claim (nothing is written then)."""
        self._writes += 1
        return self.generation << VERSION_COUNTER_BITS | self._writes if self.stamp else 0

    async def _write(self, stamp: int, if_version: int | None = None) -> bool:
        """Write our marker; False when the store holds a higher stamp (we are fenced) or, with
        ``if_version``, when the marker is no longer the one read."""
        body = self._body(stamp, time.time())
        info = await self.store.put(OWNER_KEY, body, ObjectMeta.of(body, stamp, 0o600, version=stamp),
                                    if_version=if_version)
        return info.version == stamp

    async def claim(self) -> None:
        current = await self._read()
        why = conflict(current, self.identity, self.namespace)
        if why:
            self.fenced = why
            self._claimed.set()
            log.error("fenced", detail=why)
            raise Fenced(why)
        if self.floor is None:
            self.floor = await stored_max_version(self.store)
        # above the marker's generation, the version the store keeps it at (a garbled marker has
        # only that) and every version stored: the marker alone may be lost, rolled back or copied
        marked = max(_stamp(current.get("generation")), _stamp(current.get(STORED_VERSION)))
        lifted = floor_stamp(self.floor)
        if lifted > marked:
            log.warning("fence_generation_lifted", marker_generation=marked >> 32, stored_generation=lifted >> 32,
                        detail="the namespace holds versions of a later generation than its owner marker (the "
                               "marker was deleted, rolled back or copied, or objects were copied in): claimed "
                               "above them")
        stamp = next_stamp(max(marked, lifted))
        # a compare-and-swap on the marker as read: of two claims from one read, one lands
        if not await self._write(stamp, if_version=current.get(STORED_VERSION, 0)):  # as stored
            self.fenced = (conflict(await self._read(), self.identity, self.namespace)
                           or "another sidecar claimed this store prefix at the same moment")
            self._claimed.set()
            log.error("fenced", detail=self.fenced)
            raise Fenced(self.fenced)
        self.stamp = stamp  # only once the store took it: release() relies on that
        now = time.monotonic()
        self.valid_until = now + self.window
        # No clock of another machine is compared with ours: a predecessor that did not release
        # the namespace (still draining, or gone without a word) may write until its last proof
        # plus one window, so our first write waits a whole window and the margin, on our own
        # monotonic clock, from now. A released marker (heartbeat 0) or none: no wait.
        released = not current or ("heartbeat" in current and _number(current["heartbeat"], float) == 0)
        wait = 0.0 if released else self.window + self.margin
        self.writable_at = now + wait
        if wait > 0:
            log.warning("fence_wait", seconds=round(wait, 1), previous_generation=marked >> 32,
                        detail="the previous sidecar did not release this namespace; our uploads wait out its "
                               "write window (SIDECAR_FENCE_WINDOW + SIDECAR_FENCE_MARGIN)")
        if self.on_wait is not None:
            self.on_wait(self.writable_at if wait > 0 else None)
        log.info("fence_claimed", generation=self.generation)
        self._claimed.set()

    async def release(self, timeout: float) -> None:
        """On a clean exit: keep the generation, clear the heartbeat, so a successor need not wait.
        A claim still under way (a command that ends at once) is waited for, at most ``timeout``
        seconds: one that landed after the release would hold the namespace. Nothing is written
        unless our claim succeeded."""
        with anyio.move_on_after(timeout):
            await self._claimed.wait()
        if self.fenced or not self.stamp:
            return
        body = self._body(self.stamp, 0)
        await self.store.put(OWNER_KEY, body, ObjectMeta.of(body, self.stamp, 0o600, version=self.stamp))

    async def before_write(self) -> None:
        """Wait until we may write and prove we still own the prefix; raises :class:`Fenced`."""
        if not self._claimed.is_set():
            await self._claimed.wait()
        if self.fenced:
            raise Fenced(self.fenced)
        now = time.monotonic()
        if now < self.writable_at:
            await anyio.sleep(self.writable_at - now)
        if time.monotonic() < self.valid_until:
            return
        async with self._lock:
            if self.fenced:
                raise Fenced(self.fenced)
            if time.monotonic() < self.valid_until:
                return
            t = time.monotonic()
            if not await self._write(self.stamp):
                marker = await self._read()
                theirs = _stamp(marker.get("generation")) >> 32
                who = (f"a newer sidecar (generation {theirs})" if theirs != self.generation else
                       f"another sidecar that claimed generation {theirs} at the same moment")
                self.fenced = (conflict(marker, self.identity, self.namespace) or
                               f"{who} owns this store prefix; this one (generation {self.generation}) stopped writing")
                log.error("fenced", detail=self.fenced)
                raise Fenced(self.fenced)
            self.valid_until = t + self.window


#: Stamps above this are malformed (a generation in the high bits, 32 random bits below).
MAX_STAMP = 2**62  # so that the next stamp still fits a signed 64-bit mtime


def _number(value: object, kind: type) -> float:
    """A marker field as a number; 0 when missing, malformed or out of range (a marker someone
    else wrote)."""
    try:
        number = kind(value or 0)
    except (TypeError, ValueError, OverflowError):
        return kind(0)
    if not 0 <= number <= MAX_STAMP:  # also NaN
        return kind(0)
    return number


def _stamp(value: object) -> int:
    """A marker's ``generation`` field (a stamp); 0 when missing, malformed or out of range."""
    return int(_number(value, int))
