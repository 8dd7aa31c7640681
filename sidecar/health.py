"""Health: the one owner of what ``/livez`` and ``/readyz`` report.

Every degradation is recorded here, each by the part that sees it, through a method (never by
setting attributes): the daemon's phase, the roots it cannot read and those gone as a whole, the
restore's phase, the watcher's polling (:meth:`Health.watch_polling`), the store failing
(:meth:`Health.store_degraded`, from :class:`sidecar.retry.StoreHealth`), the fence's wait for a
predecessor's write window (:meth:`Health.uploads_wait_until`) and being fenced
(:attr:`Phase.FENCED`). Readers (``http.py``) read this object only. Plain data on the event
loop, no I/O; times are ``time.monotonic()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

from sidecar import log, metrics


class Phase(StrEnum):
    """The sidecar's phase: starting → restoring → reconciling → ready → stopping, or fenced once
    a newer sidecar owns the namespace."""

    STARTING = "starting"
    RESTORING = "restoring"
    RECONCILING = "reconciling"
    READY = "ready"
    STOPPING = "stopping"
    FENCED = "fenced"


#: The phases before mirroring runs: live whatever the workers and the watcher do.
STARTING_PHASES = frozenset({Phase.STARTING, Phase.RESTORING, Phase.RECONCILING})


class RestorePhase(StrEnum):
    """Where the start-up restore is: not begun, running, done (files restored or nothing to),
    failed, or skipped because the store could not be reached (``SIDECAR_RESTORE_OPTIONAL``)."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class Polling:
    """The watcher polls instead of watching: why, how often, since when (monotonic)."""

    reason: str
    every: float
    since: float


@dataclass
class Health:
    """What /livez and /readyz report. Updated through its methods by the part that knows."""

    phase: Phase = Phase.STARTING
    reason: str = "starting"
    restore: RestorePhase = RestorePhase.PENDING
    workers_alive: bool = False
    watcher_alive: bool = False
    namespace: str = ""  # the resolved store namespace, as shown to operators ('' for the top)
    #: roots the sidecar cannot read (name -> why): not ready while any
    unreadable_roots: dict[str, str] = field(default_factory=dict)
    #: roots gone as a whole while the store holds their files (name -> why, said in /readyz):
    #: not ready while any; nothing stored of them is deleted
    gone_roots: dict[str, str] = field(default_factory=dict)
    #: monotonic time before which uploads wait for a predecessor's write window (None: no wait)
    uploads_wait: float | None = None
    #: monotonic time store operations began failing (None: they work)
    store_failing_since: float | None = None
    #: the watcher polls (an inotify limit used up); None while inotify watches
    polling: Polling | None = None

    # -- told by the parts ---------------------------------------------------------------------
    def set(self, phase: Phase, reason: str) -> None:
        self.phase, self.reason = phase, reason
        log.debug("phase", phase=str(phase), reason=reason)

    def restore_phase(self, phase: RestorePhase) -> None:
        self.restore = phase

    def alive(self, *, workers: bool | None = None, watcher: bool | None = None) -> None:
        """The upload workers or the watcher are running (True) or have stopped (False)."""
        if workers is not None:
            self.workers_alive = workers
        if watcher is not None:
            self.watcher_alive = watcher

    def root_readable(self, name: str, why_not: str | None) -> None:
        """The root ``name`` cannot be read (``why_not``), or can (None)."""
        if why_not is None:
            self.unreadable_roots.pop(name, None)
        else:
            self.unreadable_roots[name] = why_not
        self._count_roots()

    def root_gone(self, name: str, why: str | None) -> None:
        """The root ``name`` is gone as a whole (``why``: what /readyz says), or back (None)."""
        if why is None:
            self.gone_roots.pop(name, None)
        else:
            self.gone_roots[name] = why
        self._count_roots()

    def _count_roots(self) -> None:
        if metrics.loaded() or self.unreadable_roots or self.gone_roots:
            metrics.ROOTS_UNREADABLE.set(len(self.unreadable_roots.keys() | self.gone_roots.keys()))

    def store_degraded(self, since: float | None) -> None:
        """Told by the uploader's StoreHealth when store operations began failing (None: they work)."""
        self.store_failing_since = since

    def watch_polling(self, reason: str | None, every: float = 0.0) -> None:
        """Told by the watcher when it polls every ``every`` seconds (``reason``: why) or watches
        with inotify again (None)."""
        if reason is None:
            self.polling = None
        elif self.polling is None:
            self.polling = Polling(reason, every, time.monotonic())

    def uploads_wait_until(self, until: float | None) -> None:
        """Told by the fence when our uploads may begin (shown in /readyz and metrics)."""
        self.uploads_wait = until
        metrics.FENCE_WAIT.set(max(0.0, until - time.monotonic()) if until is not None else 0)

    # -- read by http.py -----------------------------------------------------------------------
    def waiting(self) -> float | None:
        """Seconds our uploads still wait for a predecessor, or None."""
        if self.uploads_wait is None:
            return None
        left = self.uploads_wait - time.monotonic()
        return left if left > 0 else None

    def store_degraded_seconds(self) -> float | None:
        """Seconds the store has been failing, or None."""
        since = self.store_failing_since
        return None if since is None else max(0.0, time.monotonic() - since)

    @property
    def ready(self) -> bool:
        return self.phase == Phase.READY and not self.unreadable_roots and not self.gone_roots

    @property
    def not_ready_because(self) -> str:
        """Why the sidecar is not ready (its phase's reason, or what it cannot read)."""
        if self.phase != Phase.READY or not (self.unreadable_roots or self.gone_roots):
            return self.reason
        why = []
        if self.unreadable_roots:
            why.append("; ".join(self.unreadable_roots.values())
                       + " (nothing of it is mirrored: run the sidecar as the host's user)")
        why.extend(self.gone_roots.values())
        return "; ".join(why)
