"""Fencing: when a new compute's sidecar starts while an old one is still draining, the old one must
never overwrite or delete the new one's files.

The store holds an owner marker, ``.sidecar/owner``: ``{"generation": N, "owner": id, "heartbeat":
unix time}``, written with ``mtime_ns = N`` so the stores' own stale-write protection refuses a
marker of a lower generation. Protocol:

* **claim** (start-up, once the restore is done, beside the first reconcile): read the marker, write
  generation ``N+1``. No write of ours happens before it. If the previous owner's heartbeat is
  recent, wait out its write window before the first write of ours (reads, restore, the host's
  start and readiness are not delayed, only our uploads).
* **before writing**, at most once per ``window`` seconds: re-write the marker with our generation
  and a fresh heartbeat. If the store refuses it (a higher generation is there), we are fenced:
  nothing more is written, and the work stays pending for the operator to see.

A writer thus writes only within ``window`` seconds of proving it still owns the prefix, and a new
owner waits ``window + margin`` after the old one's last proof before writing: time-based fencing
as in lease protocols, correct while clocks agree within ``margin`` and no single write takes longer.
One marker write per window while uploading; none while idle.
"""

from __future__ import annotations

import json
import time
import uuid

import anyio

from sidecar import log
from sidecar.store.base import NotFound, ObjectMeta, Store

OWNER_KEY = ".sidecar/owner"


class Fenced(Exception):
    """A newer sidecar owns this store prefix."""


class Fence:
    def __init__(self, store: Store, window: float = 2.0, margin: float = 8.0) -> None:
        self.store = store
        self.window = window
        self.margin = margin
        self.owner = uuid.uuid4().hex
        self.generation = 0
        self.writable_at = 0.0  # monotonic time before which we do not write
        self.valid_until = 0.0  # monotonic time our last proof of ownership expires
        self.fenced: str | None = None
        self._lock = anyio.Lock()
        self._claimed = anyio.Event()  # set when claim() has ended, claimed or fenced

    async def _read(self) -> dict:
        try:
            data, _ = await self.store.get(OWNER_KEY)
            return json.loads(data)
        except NotFound:
            return {}
        except ValueError:
            return {}

    async def _write(self, generation: int) -> bool:
        """Write our marker; False when the store holds a higher generation (we are fenced)."""
        body = json.dumps({"generation": generation, "owner": self.owner, "heartbeat": time.time()}).encode()
        info = await self.store.put(OWNER_KEY, body, ObjectMeta.of(body, generation, 0o600))
        return info.mtime_ns == generation

    async def claim(self) -> None:
        current = await self._read()
        previous = _number(current.get("generation"), int)
        if not await self._write(previous + 1):
            self.fenced = "another sidecar claimed this store prefix at the same moment"
            self._claimed.set()
            log.error("fenced", detail=self.fenced)
            raise Fenced(self.fenced)
        self.generation = previous + 1  # only once the store took it: release() relies on that
        now = time.monotonic()
        self.valid_until = now + self.window
        beat = _number(current.get("heartbeat"), float)
        wait = beat + self.window + self.margin - time.time()
        self.writable_at = now + max(0.0, wait)
        if wait > 0:
            log.warning("fence_wait", seconds=round(wait, 1), previous_generation=previous,
                        detail="a previous sidecar wrote recently; our uploads wait out its write window")
        log.info("fence_claimed", generation=self.generation)
        self._claimed.set()

    async def release(self) -> None:
        """On a clean exit: keep the generation, clear the heartbeat, so a successor need not wait.
        Nothing is written unless our claim succeeded."""
        if self.fenced or not self.generation:
            return
        body = json.dumps({"generation": self.generation, "owner": self.owner, "heartbeat": 0}).encode()
        await self.store.put(OWNER_KEY, body, ObjectMeta.of(body, self.generation, 0o600))

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
            if not await self._write(self.generation):
                current = await self._read()
                self.fenced = (f"a newer sidecar (generation {current.get('generation')}) owns this store "
                               f"prefix; this one (generation {self.generation}) stopped writing")
                log.error("fenced", detail=self.fenced)
                raise Fenced(self.fenced)
            self.valid_until = t + self.window


def _number(value: object, kind: type) -> int | float:
    """A marker field as a number; 0 when missing or malformed (a marker someone else wrote)."""
    try:
        return kind(value or 0)
    except (TypeError, ValueError, OverflowError):
        return kind(0)
