"""Fencing: a draining sidecar never overwrites or deletes its successor's files. The rules; why
they suffice (time-based fencing as in lease protocols): docs/MIRRORING.md, "Fencing".

The store holds an owner marker, ``.sidecar/owner``: ``{"generation": stamp, "owner": id,
"heartbeat": unix time or 0 once released, "identity": {variable: value}}``, written with
``version = stamp`` so the store's supersede rule refuses a marker with a lower stamp. A stamp is
the generation in its high bits and 32 random bits below (:func:`next_stamp`). A marker of an older
version (``generation`` a plain small number) is below every stamp; an older version reading a
stamp claims ``stamp + 1``. The marker's fields, read and compare-and-swap are
:mod:`sidecar.marker`'s, its only writer; the fence, the take-over and hand-over
(:mod:`sidecar.takeover`) and ``prune`` write through it. Every other write goes through
:class:`sidecar.writer.Writer`, which asks :meth:`Fence.before_write` first.

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

* **pruning** (``checkpoint-sidecar prune``, :mod:`sidecar.ops.prune`) takes an ended namespace through
  this marker like an owner: a marker at a higher stamp with ``"prune": {"phase": "pending"}``,
  then, after a grace, ``"deleting"``; it deletes only while the marker is still its own and
  removes the marker last. Before its restore a starting sidecar (:func:`take_for_restore`) takes
  over a ``pending`` prune marker, and a released one, at once (prune's next swap then fails and
  it keeps every object); it waits out a ``deleting`` one, then starts empty. A claim that finds
  ``deleting`` is fenced: what it restored may be half deleted.
* **interval**: the marker records ``SIDECAR_HEARTBEAT_INTERVAL`` (``interval``): ``prune`` counts
  a marker as live while younger than twice it, and always when it is 0 (never rewritten).
* **window**: the marker records ``SIDECAR_FENCE_WINDOW`` and ``SIDECAR_FENCE_MARGIN`` (``window``,
  ``margin``): ``prune``'s grace waits the owner's ``window + margin`` when longer than its own.

Requests: one marker read per window while writing, none while idle; the heartbeat's writes."""

from __future__ import annotations

import time
import uuid
from typing import Awaitable, Callable

import anyio

from sidecar import log
from sidecar.marker import (  # noqa: F401 (OWNER_KEY, marker_identity: the daemon and lifecycle import them here)
    OWNER_KEY,
    PRUNE_DELETING,
    PRUNE_PENDING,
    STORED_VERSION,
    Marker,
    Proof,
    floor_stamp,
    held_stamp,
    is_released,
    longer_window,
    marker_identity,
    marker_lineage,
    new_lineage,
    next_stamp,
    prune_phase,
    read_marker_info,
    stamp_of,
    stored_max_version,
    swap,
)
from sidecar.store.base import (  # noqa: F401 (the version constants are part of this module's interface)
    MAX_FLOOR_GENERATION,
    VERSION_COUNTER_BITS,
    ObjectInfo,
    Store,
)
from sidecar.takeover import IdentityConflict, Taken, conflict, hand_over, take_for_restore  # noqa: F401 (likewise)

#: fence_wait's words when the namespace holds objects but no owner marker (deleted meanwhile).
UNMARKED = "the namespace holds objects but no owner marker (deleted?): an owner may still be writing"
#: fence_wait's words when the marker found was a prune's ``pending`` one, not a sidecar's.
PRUNE_LEFT = ("a prune that did not end (killed, or cut short) left its pending marker on this namespace, so "
              "whether the sidecar before it released the namespace cannot be told")


class Fenced(Exception):
    """A newer sidecar owns this store prefix."""


class Fence:
    """Ownership of the namespace (see the protocol above); its marker written through
    :mod:`sidecar.marker`. ``clock`` is the monotonic clock windows are counted on (its
    :class:`~sidecar.marker.Proof`'s) and ``sleep`` waits on it (both replaceable by a test's
    fake clock)."""

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
        self.proof = Proof(window, self.clock)  # our last proof of ownership
        #: the namespace's lineage id our marker carries (sidecar.marker.marker_lineage), once claimed
        self.lineage: str | None = None
        #: the write window our marker records: ours, or a held predecessor's when longer
        self.recorded_window = window
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

    @property
    def valid_until(self) -> float:
        """Monotonic time our last proof of ownership expires."""
        return self.proof.until

    @valid_until.setter
    def valid_until(self, until: float) -> None:
        self.proof.until = until

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
        ours = Marker(stamp, self.owner, time.time() if heartbeat is None else heartbeat, self.identity,
                      self.interval, self.recorded_window, self.margin, lineage=self.lineage)
        info = await swap(self.store, ours, stamp, if_version=if_version, expected=self._marker)
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
        marked = held_stamp(current)
        lifted = floor_stamp(self.floor)
        if lifted > marked:
            log.warning("fence_generation_lifted", marker_generation=marked >> 32, stored_generation=lifted >> 32,
                        detail="the namespace holds versions of a later generation than its owner marker (the "
                               "marker was deleted, rolled back or copied, or objects were copied in): claimed "
                               "above them")
        stamp = next_stamp(max(marked, lifted))
        # the namespace's lineage id, carried on; made at its first claim (or a marker without one)
        self.lineage = marker_lineage(current) or new_lineage()
        # a held predecessor's longer window is recorded on: should we die before it has passed,
        # the next claim still waits it out
        if not is_released(current):
            self.recorded_window = longer_window(current, self.window, self.margin)
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
        self.proof.proved(sent)  # a proof counts from its send
        # No clock of another machine is compared with ours: a predecessor that did not release
        # the namespace (still draining, or gone without a word) may write until its last proof
        # plus one window, so our first write waits a whole window and the margin, on our own
        # monotonic clock, from now. A released marker (heartbeat 0), or none over a namespace that
        # holds nothing: no wait. None over stored objects (a marker deleted to "clear a lock")
        # tells nothing of an owner that may still write: waited out like a held one.
        released = is_released(current) or (not current and not self.floor)
        unmarked = not current and not released
        pruned = prune_phase(current) == PRUNE_PENDING
        if self.taken is not None and self.taken.stamp and current.get(STORED_VERSION) == self.taken.stamp:
            released = self.taken.released  # our take-over marker stands for the one it replaced
            pruned = self.taken.prune
        wait = 0.0 if released else longer_window(current, self.window, self.margin) + self.margin
        self.writable_at = now + wait
        self.waited = wait > 0
        if wait > 0:
            log.warning("fence_wait", seconds=round(wait, 1), previous_generation=marked >> 32,
                        detail=(PRUNE_LEFT if pruned else UNMARKED if unmarked
                                else "the previous sidecar did not release this namespace")
                        + "; our uploads wait out its write window (its SIDECAR_FENCE_WINDOW + SIDECAR_FENCE_MARGIN "
                          "as its marker records them, or ours when longer)")
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
            if self.proof.fresh():
                return
            async with self._lock:
                self._check()
                if not self.proof.fresh():
                    await self._prove()
                    if not self.proof.fresh() and not self._slow_warned:
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
        theirs = held_stamp(marker)
        if stamp_of(marker.get("generation")) == self.stamp == stamp_of(marker.get(STORED_VERSION)):
            self.proof.proved(t)
            return
        if theirs <= self.stamp:  # lost, rolled back or garbled: ours again
            t = self.clock()
            if await self._write(self.stamp):
                self.proof.proved(t)
                return
            marker = await self._read()
            theirs = held_stamp(marker)
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
                self.proof.extended(t)
                return
            await self._prove()
