"""Backoff and bounded retries for store operations that failed transiently."""

from __future__ import annotations

import random
import time
from typing import Any, Awaitable, Callable, TypeVar

import anyio

from sidecar import log
from sidecar.store.base import StoreError, TransientStoreError

T = TypeVar("T")

BACKOFF_START = 0.1
BACKOFF_MAX = 30.0


def backoff(attempt: int) -> float:
    """Exponential backoff with full jitter: uniform in [d/2, d], d = 0.1 s doubling up to 30 s."""
    d = min(BACKOFF_MAX, BACKOFF_START * (2 ** max(0, attempt - 1)))
    return random.uniform(d / 2, d)


async def retry_transient(fn, what: str, deadline: float):
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
