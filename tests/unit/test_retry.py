"""Retry and StoreHealth (sidecar.retry): what one failed attempt counts, logs and waits."""

from __future__ import annotations

import anyio
import pytest

from sidecar import metrics
from sidecar import retry as retry_mod
from sidecar.localfs import Unstable
from sidecar.retry import BACKOFF_MAX, FULL_RETRY_MAX, StoreHealth, backoff
from sidecar.store.base import StoreError, StoreFull, TransientStoreError


@pytest.fixture
def waits(monkeypatch):
    """The waits the retries asked for (not waited), with backoff at its upper bound."""
    asked: list[float] = []

    async def sleep(seconds: float) -> None:
        asked.append(seconds)

    monkeypatch.setattr(retry_mod.anyio, "sleep", sleep)
    monkeypatch.setattr(retry_mod, "backoff", lambda attempt: min(BACKOFF_MAX, 0.1 * 2 ** (attempt - 1)))
    return asked


def failures(kind: str) -> float:
    return metrics.FAILURES.labels(kind)._value.get()


def test_backoff_is_equal_jitter_doubling_to_its_cap():
    for attempt, d in ((1, 0.1), (2, 0.2), (4, 0.8), (30, BACKOFF_MAX)):
        assert all(d / 2 <= backoff(attempt) <= d for _ in range(50))


def test_store_failures_are_counted_by_kind_backed_off_and_make_the_store_degraded(waits):
    told: list[float | None] = []
    health = StoreHealth(told.append)
    retry = health.retry(path="r/a", op="upload")
    before = {k: failures(k) for k in ("transient", "store")}
    retries = metrics.RETRIES._value.get()

    async def main():
        assert await retry.failed(TransientStoreError("throttled"))
        assert await retry.failed(StoreError("denied"))
        assert await retry.failed(StoreFull("full"))

    anyio.run(main)
    assert waits == [0.1, 0.2 * 4, min(0.4, FULL_RETRY_MAX)]
    assert failures("transient") == before["transient"] + 2 and failures("store") == before["store"] + 1
    assert metrics.RETRIES._value.get() == retries + 3
    assert health.failing_since is not None and told == [health.failing_since]
    assert metrics.DEGRADED._value.get() == 1
    retry.succeeded()
    assert retry.attempt == 0 and health.failing_since is None and told[-1] is None
    assert metrics.DEGRADED._value.get() == 0


def test_a_full_store_is_retried_within_full_retry_max(waits):
    retry = StoreHealth().retry(op="claim")

    async def main():
        for _ in range(12):
            await retry.failed(StoreFull("full"))

    anyio.run(main)
    assert max(waits) == FULL_RETRY_MAX


def test_internal_errors_give_up_for_now_and_unstable_files_never_do(waits):
    retry = StoreHealth().retry(path="r/a", op="upload")
    unstable, internal = failures("unstable"), failures("internal")

    async def main():
        assert await retry.failed(Unstable(), give_up=3)
        assert await retry.failed(RuntimeError("bug"), give_up=3)
        assert not await retry.failed(RuntimeError("bug"), give_up=3)  # the third attempt: given up

    anyio.run(main)
    assert waits == [0.1, 0.2]  # no wait once given up
    assert failures("unstable") == unstable + 1 and failures("internal") == internal + 2


def test_a_disk_that_moved_is_read_again_without_counting_an_attempt(waits):
    retry = StoreHealth().retry("snapshot_failed", {"path": "r"}, path="r", op="snapshot")
    unstable = failures("unstable")
    anyio.run(retry.disk_moved, 0.005)
    assert waits == [0.005] and retry.attempt == 0 and failures("unstable") == unstable + 1
