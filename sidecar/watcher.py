"""Watch the roots with inotify (``watchfiles``) and report changed paths as hints.

Events are hints only: the uploader stats and reads each path when it handles it. ``watchfiles``
yields an unordered set per batch and drops events without a path (queue overflow), so the
periodic reconcile is what guarantees convergence; this module is what makes it fast.

Roots that do not exist yet are polled (cheaply, a ``stat`` each) and the inotify watch is rebuilt
when one appears, disappears or is replaced; ``on_roots_changed`` is then called with every root so
the caller can rescan them (files created before the watch existed produce no event, and the other
roots' events not yet handed over went with the old watch).

Queue overflow: when the kernel's inotify queue (``/proc/sys/fs/inotify/max_queued_events`` events
per watch instance) fills, the kernel drops events and ``watchfiles`` drops the overflow notice
itself. Worse than the lost events, directories created meanwhile never get a watch of their own,
so later writes in them produce no event at all until the watch is rebuilt. An overflow can only
happen while the reader is behind by a whole queue (the process was stopped or starved), and then
the backlog arrives as one batch of that order: a single batch of at least an eighth of the queue
(changes are de-duplicated events) rebuilds the watch and rescans the roots, at most once per
:data:`OVERFLOW_COOLDOWN` seconds (a rescan owed meanwhile runs when it ends). A steady stream of
writes, however fast, comes in small batches and never triggers it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Awaitable, Callable

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus
from watchfiles._rust_notify import RustNotify  # the engine behind watchfiles.awatch; gives a ready point

from sidecar import log, metrics
from sidecar.paths import Root

ROOT_POLL_SECONDS = 0.5
QUEUE_LIMIT_FILE = "/proc/sys/fs/inotify/max_queued_events"
OVERFLOW_COOLDOWN = 5.0  # at most one overflow rescan this often


def _queue_limit() -> int:
    try:
        with open(QUEUE_LIMIT_FILE) as f:
            return max(1, int(f.read()))
    except (OSError, ValueError):
        return 16384  # the kernel's default


class _Overflow:
    """Says when a batch was large enough that the watch may have overflowed before it."""

    def __init__(self) -> None:
        self.threshold = 2048
        self.queue = 16384
        self.count = 0
        self.last_rescan = float("-inf")
        self.owed = False

    def armed(self, queue: int) -> None:
        """A new inotify instance with a queue of ``queue`` events (the limit when it was made)."""
        self.queue, self.threshold = queue, max(8, queue // 8)

    def note(self, n: int) -> bool:
        """Count a batch of ``n`` changes; True when a rescan is due now."""
        if n >= self.threshold:
            self.owed = True
            self.count = max(self.count, n)
        return self.due()

    def due(self) -> bool:
        return self.owed and time.monotonic() - self.last_rescan >= OVERFLOW_COOLDOWN

    def rescanned(self) -> int:
        count, self.count, self.owed = self.count, 0, False
        self.last_rescan = time.monotonic()
        return count


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if os.path.isdir(path) else None


async def watch(
    roots: list[Root],
    on_paths: Callable[[list[str]], Awaitable[None]],
    on_roots_changed: Callable[[list[Root]], Awaitable[None]],
    *,
    debounce_ms: int = 25,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run until cancelled. Signals ``task_status.started()`` once the first watch is in place."""
    started = False
    rescan: list[Root] = []
    overflow = _Overflow()
    while True:
        ids = {r.path: _identity(r.path) for r in roots}
        present = [r.path for r in roots if ids[r.path] is not None]
        stop = threading.Event()
        notify = None
        if present:
            try:
                overflow.armed(_queue_limit())
                notify = RustNotify(present, False, False, 300, True, True)
            except (FileNotFoundError, OSError) as e:  # a root vanished between stat and watch
                log.warning("watch_setup_failed", exc=e)
                await anyio.sleep(ROOT_POLL_SECONDS)
                continue
        log.debug("watching", roots=",".join(present) or "-")
        if not started:
            task_status.started()
            started = True
        if rescan:  # only now that the new watch is in place, so nothing falls between the two
            log.info("roots_changed", roots=",".join(r.path for r in rescan))
            # Every root is rescanned, not only those that changed: the other roots' events not yet
            # handed over went with the old watch, and nothing watched them until the new one.
            await on_roots_changed(list(roots))
            rescan = []
        try:
            changed = await _watch_once(roots, ids, notify, stop, on_paths, debounce_ms, overflow)
        except Exception as e:  # the watch broke (a root removed under it, a handler bug): rebuild
            # watchfiles fails the whole watch on a name that is not UTF-8 ("Unable to decode
            # path"): such names are never mirrored (localfs.unmirrorable_reason); rebuild at once
            undecodable = "Unable to decode path" in str(e)
            log.warning("watch_restarted", exc=e, **({"reason": "a file name that is not valid UTF-8 "
                        "(never mirrored); the watch is rebuilt and the roots rescanned"} if undecodable else {}))
            changed = list(roots)
            if not undecodable:
                await anyio.sleep(ROOT_POLL_SECONDS)
        finally:
            stop.set()
            if notify is not None:
                notify.close()
        rescan = changed


async def _watch_once(roots, ids, notify, stop, on_paths, debounce_ms, overflow: _Overflow | None = None) -> list[Root]:
    """Pump events until a root appears, disappears or is replaced, or the queue may have
    overflowed; returns the roots to rescan once the watch is rebuilt."""
    changed: list[Root] = []
    overflow = overflow or _Overflow()

    def overflowed() -> None:
        log.warning("watch_overflow_suspected", changes=overflow.rescanned(), queue=overflow.queue,
                    detail="a burst that may have overflowed the inotify queue: watch rebuilt, roots rescanned")
        changed.extend(r for r in roots if ids[r.path] is not None and r not in changed)
        tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:

        async def poll_roots() -> None:
            # quick while a root is missing; existing roots report their own removal as an event
            interval = ROOT_POLL_SECONDS if None in ids.values() else 4 * ROOT_POLL_SECONDS
            while True:
                await anyio.sleep(interval)
                now = [r for r in roots if _identity(r.path) != ids[r.path]]
                if now:
                    changed.extend(now)
                    tg.cancel_scope.cancel()
                    return
                if overflow.due():  # owed from a burst during the cooldown
                    overflowed()
                    return

        async def on_batch(paths: list[str]) -> None:
            # A root itself reported (removed or replaced): its inotify watch is dead even if a new
            # directory reuses the inode number, so rebuild the watch.
            hit = [r for r in roots if r.path in paths]
            await on_paths(paths)
            if hit:
                changed.extend(hit)
                tg.cancel_scope.cancel()
            elif overflow.note(len(paths)):
                overflowed()

        tg.start_soon(poll_roots)
        if notify is not None:
            tg.start_soon(_pump, notify, stop, on_batch, debounce_ms)
    return changed


#: polling step while writes are coming (ms): the added latency of a write in a busy period
ACTIVE_STEP_MS = 2
#: how long a period stays busy after its last event (s)
ACTIVE_SECONDS = 3.0


async def _pump(notify: RustNotify, stop: threading.Event, on_paths, idle_step_ms: int) -> None:
    """Hand event batches over as soon as they arrive.

    watchfiles' engine checks for events every ``step`` ms, a thread wake-up and the GIL each time
    (about 65 µs on the 2-core VM measured): 2 ms costs about 3 % of a core while nothing
    happens, 20 ms 0.32 %, 25 ms 0.26 %. So the step is ``idle_step_ms``
    (SIDECAR_DEBOUNCE_MS) while idle and 2 ms for a few seconds after any event: the first write
    after a quiet spell waits half the idle step on average, the writes of a busy turn 1 ms.
    ``debounce=0`` returns a batch at the first check that sees one (coalescing happens later).
    """
    active_until = 0.0
    while True:
        step = ACTIVE_STEP_MS if time.monotonic() < active_until else max(ACTIVE_STEP_MS, idle_step_ms)
        raw = await anyio.to_thread.run_sync(notify.watch, 0, step, 5000, stop, abandon_on_cancel=True)
        if raw in ("timeout", "signal"):
            continue
        if raw == "stop":
            return
        active_until = time.monotonic() + ACTIVE_SECONDS
        metrics.WATCH_EVENTS.inc(len(raw))
        await on_paths([path for _change, path in raw])
