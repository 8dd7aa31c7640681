"""The pending-work set: per-path coalescing and the delete barrier. Pure logic, no I/O, no clock.

Every change the watcher or a reconcile reports is ``mark``-ed with a monotonically increasing
sequence number. Per path only one entry is kept (the newest intent: upload or delete), so memory
grows with the number of distinct dirty paths, never with the number of events. An entry also
remembers ``first_seq``, the oldest change it stands for that is not yet durable.

Rules that :meth:`PendingSet.take` enforces:

* **One operation per path at a time.** A path being uploaded that changes again gets a new
  pending entry that waits until the running operation finishes, so an older version of a path can
  never land after a newer one.
* **Deletes are barriers.** A delete runs only when every upload whose ``first_seq`` is older
  than the delete is durable. The host writes checkpoint B, then deletes checkpoint A; mirroring
  the delete first would leave the store with neither, so it never happens.
* Otherwise oldest first.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Literal

Kind = Literal["upload", "delete"]
UPLOAD: Kind = "upload"
DELETE: Kind = "delete"


@dataclass
class Op:
    key: str
    kind: Kind
    first_seq: int
    last_seq: int


class PendingSet:
    def __init__(self) -> None:
        self._seq = itertools.count(1)
        self.pending: dict[str, Op] = {}
        self.inflight: dict[str, Op] = {}
        self._ready: list[tuple[int, str]] = []  # (first_seq, key) of pending ops, lazily pruned
        self._uploads: list[tuple[int, str]] = []  # (first_seq, key) of pending+inflight uploads, lazy
        self._blocked: list[tuple[int, str]] = []  # deletes waiting for the barrier

    # -- introspection ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.pending) + len(self.inflight)

    def path_count(self) -> int:
        """Distinct paths with work owed (a path running and changed again counts once)."""
        return len(self.pending) + sum(1 for k in self.inflight if k not in self.pending)

    def idle(self) -> bool:
        return not self.pending and not self.inflight

    def keys(self) -> set[str]:
        return set(self.pending) | set(self.inflight)

    # -- producers -------------------------------------------------------------------------
    def mark(self, key: str, kind: Kind) -> Op:
        """Record that ``key`` must be uploaded or deleted (newest intent wins)."""
        seq = next(self._seq)
        op = self.pending.get(key)
        if op is None:
            op = Op(key, kind, seq, seq)
            self.pending[key] = op
            if key not in self.inflight:
                heapq.heappush(self._ready, (op.first_seq, key))
        else:
            if kind == UPLOAD and op.kind == DELETE and key not in self.inflight:
                # The delete may be held behind the barrier; an upload never is (and, being owed
                # since ``first_seq``, may be what holds the barrier shut): ready it now.
                heapq.heappush(self._ready, (op.first_seq, key))
            op.kind = kind
            op.last_seq = seq
        if kind == UPLOAD:
            heapq.heappush(self._uploads, (op.first_seq, key))
        return op

    # -- consumers -------------------------------------------------------------------------
    def _min_upload_seq(self) -> int | None:
        """Oldest ``first_seq`` among pending or running uploads (pruning stale heap items)."""
        h = self._uploads
        while h:
            seq, key = h[0]
            for table in (self.inflight, self.pending):
                op = table.get(key)
                if op is not None and op.kind == UPLOAD and op.first_seq == seq:
                    return seq
            heapq.heappop(h)
        return None

    def _barrier_open(self, op: Op) -> bool:
        # ``last_seq`` of a delete is when the delete happened: every upload owed from before it
        # must be durable first.
        oldest = self._min_upload_seq()
        return oldest is None or oldest > op.last_seq

    def take(self) -> Op | None:
        """The next operation that may start now (marked running), or None."""
        # Deletes held by the barrier go first once it opens: they are the oldest work.
        while self._blocked:
            seq, key = self._blocked[0]
            op = self.pending.get(key)
            if op is None or op.kind != DELETE or op.last_seq != seq or key in self.inflight:
                heapq.heappop(self._blocked)
                if op is not None and key not in self.inflight:
                    heapq.heappush(self._ready, (op.first_seq, key))
                continue
            if not self._barrier_open(op):
                break
            heapq.heappop(self._blocked)
            return self._start(op)
        while self._ready:
            seq, key = heapq.heappop(self._ready)
            op = self.pending.get(key)
            if op is None or op.first_seq != seq or key in self.inflight:
                continue  # stale heap item
            if op.kind == DELETE and not self._barrier_open(op):
                heapq.heappush(self._blocked, (op.last_seq, key))
                continue
            return self._start(op)
        return None

    def take_all(self) -> list[Op]:
        """Every pending operation whose path is not running, barriers ignored: for callers that
        make a whole batch visible atomically (snapshot commits)."""
        ops = [op for key, op in list(self.pending.items()) if key not in self.inflight]
        for op in ops:
            self._start(op)
        return ops

    def _start(self, op: Op) -> Op:
        del self.pending[op.key]
        self.inflight[op.key] = op
        return op

    def done(self, op: Op) -> None:
        """The operation is durable (or definitively moot)."""
        self.inflight.pop(op.key, None)
        nxt = self.pending.get(op.key)
        if nxt is not None:
            heapq.heappush(self._ready, (nxt.first_seq, nxt.key))

    def retry(self, op: Op) -> None:
        """The operation failed and must run again, keeping its place in the order."""
        self.inflight.pop(op.key, None)
        nxt = self.pending.get(op.key)
        if nxt is None:
            self.pending[op.key] = op
            nxt = op
        else:  # changed again meanwhile: newest intent, but still owes the older change
            nxt.first_seq = min(nxt.first_seq, op.first_seq)
        heapq.heappush(self._ready, (nxt.first_seq, nxt.key))
        if nxt.kind == UPLOAD:
            heapq.heappush(self._uploads, (nxt.first_seq, nxt.key))
