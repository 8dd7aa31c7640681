"""Health and metrics endpoints (placeholder until the operations issue lands)."""

from __future__ import annotations

import anyio


async def serve(settings, daemon, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
    task_status.started()


def probe(settings, what: str, timeout: float) -> int:
    return 1
