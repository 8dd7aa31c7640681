"""Watch the roots with inotify (``watchfiles``) and report changed paths as hints.

Events are hints only: the uploader stats and reads each path when it handles it. ``watchfiles``
yields an unordered set per batch and drops events without a path (queue overflow), so the
periodic reconcile is what guarantees convergence; this module is what makes it fast.

Roots that do not exist yet are polled (cheaply, a ``stat`` each) and the inotify watch is rebuilt
when one appears, disappears or is replaced; ``on_roots_changed`` is then called so the caller can
rescan them (files created before the watch existed produce no event).
"""

from __future__ import annotations

import os
import threading
from typing import Awaitable, Callable

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus
from watchfiles._rust_notify import RustNotify  # the engine behind watchfiles.awatch; gives a ready point

from sidecar import log, metrics
from sidecar.paths import Root

ROOT_POLL_SECONDS = 0.25


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
    debounce_ms: int = 10,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run until cancelled. Signals ``task_status.started()`` once the first watch is in place."""
    started = False
    rescan: list[Root] = []
    while True:
        ids = {r.path: _identity(r.path) for r in roots}
        present = [r.path for r in roots if ids[r.path] is not None]
        stop = threading.Event()
        notify = None
        if present:
            try:
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
            await on_roots_changed(rescan)
            rescan = []
        try:
            changed = await _watch_once(roots, ids, notify, stop, on_paths, debounce_ms)
        except Exception as e:  # the watch broke (a root removed under it, a handler bug): rebuild
            log.warning("watch_restarted", exc=e)
            changed = list(roots)
            await anyio.sleep(ROOT_POLL_SECONDS)
        finally:
            stop.set()
            if notify is not None:
                notify.close()
        rescan = changed


async def _watch_once(roots, ids, notify, stop, on_paths, debounce_ms) -> list[Root]:
    """Pump events until a root appears, disappears or is replaced; returns those roots."""
    changed: list[Root] = []
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

        async def on_batch(paths: list[str]) -> None:
            # A root itself reported (removed or replaced): its inotify watch is dead even if a new
            # directory reuses the inode number, so rebuild the watch.
            hit = [r for r in roots if r.path in paths]
            await on_paths(paths)
            if hit:
                changed.extend(hit)
                tg.cancel_scope.cancel()

        tg.start_soon(poll_roots)
        if notify is not None:
            tg.start_soon(_pump, notify, stop, on_batch, debounce_ms)
    return changed


async def _pump(notify: RustNotify, stop: threading.Event, on_paths, debounce_ms: int) -> None:
    step = max(1, min(2, debounce_ms))  # quiet time that ends a batch; debounce caps it
    while True:
        raw = await anyio.to_thread.run_sync(notify.watch, debounce_ms, step, 1000, stop, abandon_on_cancel=True)
        if raw in ("timeout", "signal"):
            continue
        if raw == "stop":
            return
        metrics.WATCH_EVENTS.inc(len(raw))
        await on_paths([path for _change, path in raw])
