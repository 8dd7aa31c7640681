"""Fencing: a draining sidecar never overwrites or deletes its successor's files. The rules; why
they suffice (time-based fencing as in lease protocols): docs/MIRRORING.md, "Fencing".

The store holds an owner marker, ``.sidecar/owner``: ``{"generation": stamp, "owner": id,
"heartbeat": unix time or 0 once released, "identity": {variable: value}}``, written with
``version = stamp`` so the store's supersede rule refuses a marker with a lower stamp. A stamp is
the generation in its high bits and 32 random bits below (:func:`next_stamp`). A marker of an older
version (``generation`` a plain small number) is below every stamp; an older version reading a
stamp claims ``stamp + 1``. The fence is the only writer of the marker; every other write goes
through :class:`sidecar.writer.Writer`, which asks :meth:`Fence.before_write` first.

* **claim** (once the restore is done): read the marker, write the next stamp (a compare-and-swap
  on the marker as read); no write of ours before it. The claim's generation is above every
  version stored in the namespace (``floor``, from the start-up listing), not only the marker's.
  If the previous owner has not released (heartbeat not 0), the first write waits
  ``window + margin`` after the claim on our own monotonic clock; reads are not delayed.
* **proof, before writing**, at most once per ``window`` seconds: *read* the marker. Our stamp
  there proves ownership for one window from the moment the read was sent. A higher stamp: fenced,
  nothing more is written, the work stays pending. No marker or a lower one: ours is written again
  (the store refuses it if a higher one is there).
* **heartbeat**, every ``SIDECAR_HEARTBEAT_INTERVAL`` while mirroring (0: never): the marker with
  a fresh time, a compare-and-swap on our stamp; a refused one is settled by a proof. No proof or
  decision reads its time.
* **release** (a clean exit): the heartbeat 0, our stamp kept; no write of ours follows it.
* **identity**: the marker names the compute identity that owns the namespace
  (:mod:`sidecar.namespace`). A sidecar of another identity, or of none, is refused before it
  restores (:func:`check_identity`) and at its claim or next proof; it never fences the owner's
  successors. A marker without an identity is taken over by anyone; one that cannot be read
  (garbled, too large) by no one (``release`` rewrites it).

* **pruning** (``checkpoint-sidecar prune``, :mod:`sidecar.prune`) takes an ended namespace through
  this marker like an owner: a marker at a higher stamp with ``"prune": {"phase": "pending"}``,
  then, after a grace, ``"deleting"``; it deletes only while the marker is still its own and
  removes the marker last. Before its restore a starting sidecar (:func:`take_for_restore`) takes
  over a ``pending`` prune marker, and a released one, at once (prune's next swap then fails and
  it keeps every object); it waits out a ``deleting`` one, then starts empty. A claim that finds
  ``deleting`` is fenced: what it restored may be half deleted.
* **interval**: the marker records ``SIDECAR_HEARTBEAT_INTERVAL`` (``interval``): ``prune`` counts
  a marker as live while younger than twice it, and always when it is 0 (never rewritten).

Requests: one marker read per window while writing, none while idle; the heartbeat's writes."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

import anyio

from sidecar import log
from sidecar.namespace import command_for, describe_identity, variables_for
from sidecar.store.base import (  # noqa: F401 (the version constants are part of this module's interface)
    MAX_FLOOR_GENERATION,
    OWN_NAMESPACE,
    VERSION_COUNTER_BITS,
    NotFound,
    ObjectInfo,
    ObjectMeta,
    Store,
    StoreError,
    sane_version,
)

OWNER_KEY = f"{OWN_NAMESPACE}/owner"

#: A prune marker's field: ``{"phase": PRUNE_PENDING or PRUNE_DELETING}`` (see :mod:`sidecar.prune`).
PRUNE_FIELD = "prune"
PRUNE_PENDING, PRUNE_DELETING = "pending", "deleting"
#: A prune marker's ``owner`` begins with this; a starting sidecar's take-over marker with RESUMING.
PRUNE_OWNER, RESUMING = "prune:", "resuming:"
#: How long a starting sidecar waits for a prune deleting its namespace to end (then: exit 1).
PRUNE_WAIT_SECONDS = 300.0


def prune_phase(marker: dict) -> str | None:
    """The phase of a prune marker (:data:`PRUNE_PENDING`, :data:`PRUNE_DELETING`); None for
    any other marker."""
    value = marker.get(PRUNE_FIELD) if isinstance(marker, dict) else None
    phase = value.get("phase") if isinstance(value, dict) else None
    return phase if phase in (PRUNE_PENDING, PRUNE_DELETING) else None


def is_released(marker: dict) -> bool:
    """Whether an owner marker says its owner released the namespace (heartbeat 0)."""
    return isinstance(marker, dict) and "heartbeat" in marker and _number(marker["heartbeat"], float) == 0



class Fenced(Exception):
    """A newer sidecar owns this store prefix."""


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


async def _marker_bytes(store: Store) -> tuple[bytes | None, ObjectInfo]:
    """The marker's bytes (None when larger than :data:`MAX_MARKER_BYTES`: never read whole) and
    the marker as the store holds it; :class:`NotFound` when there is none."""
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
    return (bytes(data) if fits else None), info


async def read_marker(store: Store) -> dict:
    """The owner marker's fields, plus :data:`STORED_VERSION`; {} when there is none. A marker
    that cannot be read as one (larger than :data:`MAX_MARKER_BYTES`, not a JSON object, nested
    too deep) has no fields but its stored version and :data:`UNREADABLE`: whose namespace it is
    cannot be told, so no claim takes it over (:func:`conflict`); ``release`` rewrites it."""
    return (await read_marker_info(store))[0]


async def read_marker_info(store: Store) -> tuple[dict, ObjectInfo | None]:
    """:func:`read_marker`'s fields and the marker as the store holds it (None: there is none),
    which the next write of the marker passes as ``expected`` (``Store.put``)."""
    try:
        data, info = await _marker_bytes(store)
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


def marker_generation(marker: dict) -> int:
    """The generation an owner marker (as :func:`read_marker` gives it) holds the namespace at:
    that of its stamp or of the version the store keeps it at, whichever is higher (0: none)."""
    return max(_stamp(marker.get("generation")), _stamp(marker.get(STORED_VERSION))) >> 32


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
        found = Taken(marker_generation(marker), 0, released, pruned, bool(marker))
        if not take or not (phase == PRUNE_PENDING or (marker and released)):
            return found
        seen = marker.get(STORED_VERSION, 0)
        stamp = later_stamp(max(_stamp(marker.get("generation")), _stamp(seen)))
        body: dict = {"generation": stamp, "owner": RESUMING + uuid.uuid4().hex, "heartbeat": time.time()}
        if identity:
            body["identity"] = identity
        data = json.dumps(body).encode()
        put = await store.put(OWNER_KEY, data, ObjectMeta.of(data, stamp, 0o600, version=stamp), if_version=seen,
                              expected=info)
        if put.version == stamp:
            if phase == PRUNE_PENDING:
                log.info("prune_cancelled", namespace=log.printable(where),
                         detail="a prune was about to delete this namespace: taken over, every object kept")
            # a prune's pending marker hid whether the owner before it had released: wait as if not
            return Taken(found.generation, stamp, released and phase is None, pruned, True)
        # changed since it was read (a prune's next phase, another claim): read it again


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
        current, marker = await read_marker_info(store)
        if not current:
            return None
        seen = current.get(STORED_VERSION, 0)  # as stored: the swap compares it, even out of range
        stamp = next_stamp(max(_stamp(current.get("generation")), _stamp(seen), floor))
        held = not ("heartbeat" in current and _number(current["heartbeat"], float) == 0)
        body = json.dumps({"generation": stamp, "owner": HANDED_OVER, "heartbeat": time.time() if held else 0}).encode()
        info = await store.put(OWNER_KEY, body, ObjectMeta.of(body, stamp, 0o600, version=stamp), if_version=seen,
                               expected=marker)
        if info.version == stamp:
            return Handover(marker_identity(current), stamp >> 32, held)
    raise StoreError("the owner marker changed at every attempt (a sidecar keeps claiming this namespace): "
                     "stop it, then release again")


class Fence:
    """The owner marker's only writer (see the protocol above). ``clock`` is the monotonic clock
    windows are counted on and ``sleep`` waits on it (both replaceable by a test's fake clock)."""

    def __init__(self, store: Store, window: float = 2.0, margin: float = 8.0,
                 identity: dict[str, str] | None = None, namespace: str = "",
                 on_wait: Callable[[float | None], None] | None = None, floor: int | None = None,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], Awaitable[None]] | None = None,
                 taken: Taken | None = None, interval: float | None = None, store_url: str = "") -> None:
        self.store = store
        self.store_url = store_url  # SIDECAR_STORE, for the hints of a refusal (conflict)
        #: what the start-up's take_for_restore wrote (its marker stands for the one it replaced)
        self.taken = taken
        #: SIDECAR_HEARTBEAT_INTERVAL, recorded in the marker for prune (None: not recorded)
        self.interval = interval
        #: the highest version stored in the namespace, the claim's generation goes above it
        #: (None: not known, listed at the claim)
        self.floor = floor
        self.on_wait = on_wait  # told the monotonic time our writes may begin (None: at once)
        self.identity = dict(identity or {})
        self.namespace = namespace
        self.window = window
        self.margin = margin
        self.clock = clock if clock is not None else time.monotonic
        self.sleep = sleep if sleep is not None else anyio.sleep
        self.owner = uuid.uuid4().hex
        self.stamp = 0  # ours once claimed: see next_stamp
        self.writable_at = 0.0  # monotonic time before which we do not write
        #: the claim waited out a predecessor that had not released the namespace: what it wrote
        #: in its window may differ from what our restore listed (see Writer.took_over)
        self.waited = False
        self.valid_until = 0.0  # monotonic time our last proof of ownership expires
        self.fenced: str | None = None
        self.released = False  # release() ran: nothing more of ours is written
        self._writes = 0
        self._slow_warned = False
        self._lock = anyio.Lock()
        self._claimed = anyio.Event()  # set when claim() has ended, claimed or fenced
        self._marker: ObjectInfo | None = None  # the marker as last read or written: what a write expects

    async def _read(self) -> dict:
        marker, self._marker = await read_marker_info(self.store)
        return marker

    def _body(self, stamp: int, heartbeat: float) -> bytes:
        marker: dict = {"generation": stamp, "owner": self.owner, "heartbeat": heartbeat}
        if self.identity:
            marker["identity"] = self.identity
        if self.interval is not None:
            marker["interval"] = self.interval
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

    def newest_version(self) -> int:
        """The highest version this sidecar's writes can carry (0 before the claim): a stored
        version above it is a newer owner's."""
        return self.generation << VERSION_COUNTER_BITS | (2**VERSION_COUNTER_BITS - 1) if self.stamp else 0

    async def _write(self, stamp: int, heartbeat: float | None = None, if_version: int | None = None) -> bool:
        """Write our marker (``heartbeat``: now, unless given); False when the store holds a higher
        stamp (we are fenced) or, with ``if_version``, when the marker is no longer at that version."""
        body = self._body(stamp, time.time() if heartbeat is None else heartbeat)
        info = await self.store.put(OWNER_KEY, body, ObjectMeta.of(body, stamp, 0o600, version=stamp),
                                    if_version=if_version, expected=self._marker)
        self._marker = info
        return info.version == stamp

    async def claim(self) -> None:
        current = await self._read()
        why = conflict(current, self.identity, self.namespace, self.store_url)
        if not why and prune_phase(current) == PRUNE_DELETING:
            why = (f"the store namespace {self.namespace or '(top of the store)'!r} is being pruned (its session had "
                   "ended when checkpoint-sidecar prune began): what this sidecar restored may be half deleted, so "
                   "nothing of it is written; start again once the prune has ended (it then starts empty)")
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
        sent = self.clock()
        # a compare-and-swap on the marker as read: of two claims from one read, one lands
        if not await self._write(stamp, if_version=current.get(STORED_VERSION, 0)):  # as stored
            self.fenced = (conflict(await self._read(), self.identity, self.namespace, self.store_url)
                           or "another sidecar claimed this store prefix at the same moment")
            self._claimed.set()
            log.error("fenced", detail=self.fenced)
            raise Fenced(self.fenced)
        self.stamp = stamp  # only once the store took it: release() relies on that
        now = self.clock()
        self.valid_until = sent + self.window  # a proof counts from its send
        # No clock of another machine is compared with ours: a predecessor that did not release
        # the namespace (still draining, or gone without a word) may write until its last proof
        # plus one window, so our first write waits a whole window and the margin, on our own
        # monotonic clock, from now. A released marker (heartbeat 0) or none: no wait.
        released = not current or is_released(current)
        if self.taken is not None and self.taken.stamp and current.get(STORED_VERSION) == self.taken.stamp:
            released = self.taken.released  # our take-over marker stands for the one it replaced
        wait = 0.0 if released else self.window + self.margin
        self.writable_at = now + wait
        self.waited = wait > 0
        if wait > 0:
            log.warning("fence_wait", seconds=round(wait, 1), previous_generation=marked >> 32,
                        detail="the previous sidecar did not release this namespace; our uploads wait out its "
                               "write window (SIDECAR_FENCE_WINDOW + SIDECAR_FENCE_MARGIN)")
        if self.on_wait is not None:
            self.on_wait(self.writable_at if wait > 0 else None)
        log.info("fence_claimed", generation=self.generation)
        self._claimed.set()

    async def claimed_generation(self) -> int | None:
        """Once the claim has ended: our generation, or None when we were fenced instead."""
        await self._claimed.wait()
        return self.generation if self.stamp and not self.fenced else None

    async def release(self, timeout: float, checked: anyio.Event | None = None) -> None:
        """On a clean exit: keep the generation, clear the heartbeat, so a successor need not wait;
        no write of ours follows (:meth:`before_write` refuses from now on). A claim still under
        way (a command that ends at once) is waited for, at most ``timeout`` seconds: one that
        landed after the release would hold the namespace. Nothing is written unless our claim
        succeeded, nor when it waited out a predecessor and ``checked`` (the store compared with
        the disk since) is not set: the namespace stays held, so the next claim waits too."""
        with anyio.move_on_after(timeout):
            await self._claimed.wait()
        async with self._lock:  # not in the middle of a proof or a heartbeat
            self.released = True
            if self.fenced or not self.stamp or (self.waited and checked is not None and not checked.is_set()):
                return
            await self._write(self.stamp, heartbeat=0)

    async def wait_writable(self) -> None:
        """Wait for the claim and for a predecessor's write window to pass; raises
        :class:`Fenced`. Proves nothing (see :meth:`before_write`)."""
        if not self._claimed.is_set():
            await self._claimed.wait()
        self._check()
        now = self.clock()
        if now < self.writable_at:
            await self.sleep(self.writable_at - now)
        self._check()

    def _check(self) -> None:
        if self.fenced:
            raise Fenced(self.fenced)
        if self.released:
            raise Fenced("this sidecar released the namespace: it writes nothing more")

    async def before_write(self) -> None:
        """Wait until we may write and prove we still own the prefix (a marker read, at most once
        per window); raises :class:`Fenced`. Call it right before each write: it returns only
        while the proof is younger than the window, with no wait left before the write."""
        while True:
            await self.wait_writable()
            if self.clock() < self.valid_until:
                return
            async with self._lock:
                self._check()
                if self.clock() >= self.valid_until:
                    await self._prove()
                    if self.clock() >= self.valid_until and not self._slow_warned:
                        self._slow_warned = True
                        log.warning("fence_proof_slow", window=self.window,
                                    detail="reading the owner marker took longer than SIDECAR_FENCE_WINDOW, so each "
                                           "proof is stale before a write can use it and is taken again: raise "
                                           "SIDECAR_FENCE_WINDOW above the store's latency")
            # checked again once the lock is released: a proof may have aged meanwhile

    async def _prove(self) -> None:
        """Read the marker: ours proves one window from the send; a higher stamp fences us; none
        or a lower one is written again (refused by the store if a higher one is there). Called
        under the lock."""
        t = self.clock()
        marker = await self._read()
        theirs = max(_stamp(marker.get("generation")), _stamp(marker.get(STORED_VERSION)))
        if _stamp(marker.get("generation")) == self.stamp == _stamp(marker.get(STORED_VERSION)):
            self.valid_until = t + self.window
            return
        if theirs <= self.stamp:  # lost, rolled back or garbled: ours again
            t = self.clock()
            if await self._write(self.stamp):
                self.valid_until = t + self.window
                return
            marker = await self._read()
            theirs = max(_stamp(marker.get("generation")), _stamp(marker.get(STORED_VERSION)))
        self._fence(marker, theirs)

    def _fence(self, marker: dict, theirs: int) -> None:
        who = (f"a newer sidecar (generation {theirs >> 32})" if theirs >> 32 != self.generation else
               f"another sidecar that claimed generation {theirs >> 32} at the same moment")
        self.fenced = (conflict(marker, self.identity, self.namespace, self.store_url) or
                       f"{who} owns this store prefix; this one (generation {self.generation}) stopped writing")
        log.error("fenced", detail=self.fenced)
        raise Fenced(self.fenced)

    async def heartbeat(self) -> None:
        """Rewrite our marker with a fresh heartbeat: a compare-and-swap on our stamp, so it never
        replaces a successor's marker nor brings back a lost one. A refused heartbeat is settled
        by a proof (raises :class:`Fenced` when a newer owner is there). Nothing before the
        claim, after the release or once fenced."""
        if not self._claimed.is_set() or not self.stamp:
            return
        async with self._lock:
            if self.fenced or self.released:
                return
            t = self.clock()
            if await self._write(self.stamp, if_version=self.stamp):
                self.valid_until = max(self.valid_until, t + self.window)
                return
            await self._prove()


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
