"""Shutdown: an injectable trigger (tests set it directly), fed by signals in production.

The first SIGTERM/SIGINT asks for a graceful stop (drain, bounded by ``drain_timeout``); a second
one forces it (abandon the flush wait), as uvicorn and hypercorn do. In ``run`` mode every signal
is forwarded to the child too, SIGHUP included; the child's exit is what ends the wrapper.
"""

from __future__ import annotations

import signal
from typing import Callable

import anyio

from sidecar import log

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Shutdown:
    def __init__(self) -> None:
        self.requested = anyio.Event()
        self.forced = anyio.Event()

    def trigger(self, reason: str = "requested") -> None:
        if self.requested.is_set():
            if not self.forced.is_set():
                log.warning("shutdown_forced", reason=reason)
            self.forced.set()
        else:
            log.info("shutdown_requested", reason=reason)
            self.requested.set()


async def handle_signals(shutdown: Shutdown, forward: Callable[[int], None] | None) -> None:
    """Turn signals into shutdown requests, forwarding them to a child first when there is one."""
    sigs = STOP_SIGNALS + ((signal.SIGHUP,) if forward is not None else ())
    with anyio.open_signal_receiver(*sigs) as received:
        async for sig in received:
            if forward is not None:
                forward(sig)
            if sig in STOP_SIGNALS:
                shutdown.trigger(signal.Signals(sig).name)
