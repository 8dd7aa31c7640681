"""Backoff and bounded retries for store operations that failed transiently."""

from __future__ import annotations

import random
import time

import anyio

from sidecar import log
from sidecar.store.base import StoreError, TransientStoreError

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
