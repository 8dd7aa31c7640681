"""Backoff, bounded retries at start-up, and the retries of mirroring's store operations.

:func:`retry_transient` retries a start-up step until a deadline. Mirroring never gives up on the
store: every failed attempt of a claim, a per-file operation or a snapshot commit goes through a
:class:`Retry`, which counts it by kind (``checkpoint_sidecar_failures_total{kind}``), logs it,
backs off and tells :class:`StoreHealth` (degraded until an operation succeeds again).
"""

from __future__ import annotations

import random
import time
from typing import Any, Awaitable, Callable, TypeVar

import anyio

from sidecar import log, metrics
from sidecar.localfs import Unstable
from sidecar.store.base import StoreError, StoreFull, TransientStoreError

T = TypeVar("T")

BACKOFF_START = 0.1
BACKOFF_MAX = 30.0
#: Longest wait between retries while the store is full (StoreFull): space can come back any time.
FULL_RETRY_MAX = 2.0
#: How long start-up (and a command's opening of the store) keeps retrying a store that answers
#: with transient errors before giving up: the deadline :func:`retry_transient` is given.
STARTUP_RETRY_SECONDS = 10.0


def backoff(attempt: int) -> float:
    """Exponential backoff with equal jitter: uniform in [d/2, d], d = 0.1 s doubling up to 30 s."""
    d = min(BACKOFF_MAX, BACKOFF_START * (2 ** max(0, attempt - 1)))
    return random.uniform(d / 2, d)


async def retry_transient(fn: Callable[[], Awaitable[T]], what: str, deadline: float) -> T:
    """Call ``fn`` until it succeeds or ``deadline`` (monotonic) passes; re-raises the last error."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return await fn()
        except StoreError as e:
            delay = backoff(attempt)
            if not isinstance(e, TransientStoreError) or time.monotonic() + delay > deadline:
                raise
            log.warning("store_retry", op=what, attempt=attempt, error=str(e))
            await anyio.sleep(delay)


class StoreHealth:
    """Whether mirroring's store operations are failing: ``store_degraded`` 1 from the first failed
    attempt until the next success (``store_recovered``), and ``on_degraded`` told the monotonic
    time the failures began, then None (Health shows it in /readyz)."""

    def __init__(self, on_degraded: Callable[[float | None], None] | None = None) -> None:
        self.on_degraded = on_degraded
        #: monotonic time store operations began failing; None while they work
        self.failing_since: float | None = None

    def retry(self, event: str = "operation_failed", internal_fields: dict[str, Any] | None = None,
              **fields: Any) -> Retry:
        """The retries of one operation (or of one worker's batches): see :class:`Retry`."""
        return Retry(self, event, fields if internal_fields is None else internal_fields, fields)

    def failing(self) -> None:
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            metrics.DEGRADED.set(1)
            if self.on_degraded is not None:
                self.on_degraded(self.failing_since)

    def working(self) -> None:
        if self.failing_since is not None:
            log.info("store_recovered", seconds=round(time.monotonic() - self.failing_since, 1))
            self.failing_since = None
            metrics.DEGRADED.set(0)
            if self.on_degraded is not None:
                self.on_degraded(None)


class Retry:
    """The failed attempts of one operation, retried until it succeeds (nothing is dropped).

    :meth:`failed` counts the failure by kind and backs off ``backoff(attempt)``:

    * a store error: ``transient`` (logged ``store_retry`` as a warning) or ``store`` (an error,
      waiting four times longer), both counted in ``retries_total`` and making the store degraded;
      a full store (StoreFull) is retried after at most :data:`FULL_RETRY_MAX` seconds;
    * a file that changed while it was read (Unstable): ``unstable``;
    * anything else (a bug, an unexpected OS error): ``internal``, logged as ``event``.

    ``fields`` go with ``store_retry``, ``internal_fields`` with ``event``."""

    def __init__(self, health: StoreHealth, event: str, internal_fields: dict[str, Any], fields: dict[str, Any]) -> None:
        self.health = health
        self.event = event
        self.internal_fields = internal_fields
        self.fields = fields
        #: failed attempts since the last success
        self.attempt = 0

    async def failed(self, e: Exception, give_up: int | None = None) -> bool:
        """Count, log and back off. False (without waiting) when the caller gives up for now: a
        failure that is neither the store's nor an unstable file's, at attempt ``give_up`` or later."""
        self.attempt += 1
        attempt = self.attempt
        if isinstance(e, StoreError):
            transient = isinstance(e, TransientStoreError)
            metrics.FAILURES.labels("transient" if transient else "store").inc()
            metrics.RETRIES.inc()
            self.health.failing()
            (log.warning if transient else log.error)("store_retry", attempt=attempt, error=str(e), **self.fields)
            if isinstance(e, StoreFull):  # cheap to retry, and space can come back at any moment
                await anyio.sleep(min(backoff(attempt), FULL_RETRY_MAX))
            else:
                await anyio.sleep(backoff(attempt) * (1 if transient else 4))
            return True
        if isinstance(e, Unstable):
            metrics.FAILURES.labels("unstable").inc()
        else:
            metrics.FAILURES.labels("internal").inc()
            log.error(self.event, exc=e, **self.internal_fields, attempt=attempt)
            if give_up is not None and attempt >= give_up:
                return False
        await anyio.sleep(backoff(attempt))
        return True

    async def disk_moved(self, wait: float) -> None:
        """The disk changed while it was read (counted ``unstable``, not a failed attempt): read
        again after ``wait`` seconds, by when the host's next write has usually landed."""
        metrics.FAILURES.labels("unstable").inc()
        await anyio.sleep(wait)

    def succeeded(self) -> None:
        self.attempt = 0
        self.health.working()


#: How often a wait that has not ended says so again.
WAITING_REPORT_SECONDS = 5.0


async def reported_wait(fn: Callable[[], Awaitable[T]], what: str, every: float = WAITING_REPORT_SECONDS,
                        **fields: Any) -> T:
    """``await fn()``, saying what is being waited for once it takes longer than ``every``
    seconds, and then every ``every`` seconds (``still_waiting``): a store, a token endpoint or a
    proxy that does not answer is never a silent pause. ``fn``'s own error is raised as it is."""
    async def report() -> None:
        t0 = time.monotonic()
        while True:
            await anyio.sleep(every)
            log.warning("still_waiting", what=what, seconds=round(time.monotonic() - t0), **fields)

    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(report)
        try:
            result = await fn()
        except Exception as e:  # raised below, outside the task group (never as an exception group)
            failure = e
        tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result
