"""Watch the roots with inotify (``watchfiles``) and report changed paths as hints.

Rules (the reasons: docs/MIRRORING.md, "The watcher"):

* Events are hints only: the uploader stats and reads each path when it handles it; the periodic
  reconcile guarantees convergence, the watcher makes it fast.
* Every real directory of the roots has a watch of its own (the engine in non-recursive mode, given
  the list), found by a walk that never follows a symlink below a root (a root that is itself one
  is followed) and visits each directory (device, inode) once.
* A directory added that is not watched under that path and identity rebuilds the watch: the new
  instance is made while the old one still runs, the old one's last events are handed over before
  it is closed, then the new directories are handed over as hints. Rebuilds are spaced
  (:data:`GROW_SPACING`).
* Roots that do not exist yet are polled (a ``stat`` each); when one appears, disappears or is
  replaced the watch is rebuilt and ``on_roots_changed`` is called with every root.
* A single batch of at least an eighth of the inotify queue is taken for an overflow: the watch is
  rebuilt and the roots rescanned, at most once per :data:`OVERFLOW_COOLDOWN` seconds (a rescan
  owed meanwhile runs when it ends).
* Watches are made with ``ignore_permission_denied`` off; the walk leaves out directories this
  process cannot read. When an inotify limit is used up the watcher rescans every root each
  :data:`POLL_SECONDS` (through ``on_roots_changed``), says so once (``watch_polling``), to
  ``on_polling`` (the daemon's Health) and in ``checkpoint_sidecar_watch_polling``, and tries
  inotify again every :data:`POLL_RETRY_SECONDS`.
"""

from __future__ import annotations

import errno
import os
import re
import stat
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
POLL_SECONDS = 1.0  # rescan step while inotify is unavailable (under the reconcile's 2 s "missed" bar)
POLL_RETRY_SECONDS = 60.0  # how often polling tries inotify again
GROW_ROUNDS = 5  # builds in a row for directories that appeared during a build
GROW_SPACING = 4.0  # after a rebuild for new directories, wait this many times its duration

ADDED, DELETED = 1, 3  # watchfiles.Change
#: errnos that mean a limit is used up (instances: EMFILE; watches: ENOSPC)
LIMIT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.ENOMEM})
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class WatchLimit(Exception):
    """An inotify limit (instances or watches, per user and node-wide) is used up."""


def _as_limit(e: BaseException) -> WatchLimit | None:
    """The used-up limit that ``e``, raised by making a ``RustNotify``, reports; else None."""
    if isinstance(e, (FileNotFoundError, PermissionError)):
        return None
    text = str(e)
    m = _OS_ERROR.search(text)
    code = int(m.group(1)) if m else None
    if isinstance(e, OSError) and ("MaxFilesWatch" in text or code in LIMIT_ERRNOS):
        return WatchLimit(f"inotify watches used up (fs.inotify.max_user_watches): {text.split(' (Error')[0]}")
    if isinstance(e, RuntimeError) and "creating recommended watcher" in text and code in LIMIT_ERRNOS:
        return WatchLimit(f"no inotify instance left (fs.inotify.max_user_instances): {os.strerror(code)}")
    return None


class _Polling:
    """Whether this watch polls instead of watching (``reason``, None while inotify works): each
    change said once in the log and the gauge, and told to ``on_polling`` (the daemon's Health)."""

    def __init__(self, on_polling: Callable[[str | None, float], None] | None) -> None:
        self.reason: str | None = None
        self.on_polling = on_polling

    def set(self, reason: str | None) -> None:
        """Enter (``reason``) or leave (None) the polling state."""
        if reason is not None and self.reason is None:
            self.reason = reason
            advice = ("; inotify limits are per user and node-wide: raise fs.inotify.max_user_instances / "
                      "max_user_watches" if "fs.inotify" in reason else "")
            log.warning("watch_polling", reason=reason,
                        detail=f"every root is rescanned each {POLL_SECONDS:g}s instead, and inotify tried again "
                               f"each {POLL_RETRY_SECONDS:g}s{advice}")
            if self.on_polling is not None:
                self.on_polling(reason, POLL_SECONDS)
        elif reason is None and self.reason is not None:
            self.reason = None
            log.info("watch_inotify_restored", detail="inotify watches again; the roots are rescanned once")
            if self.on_polling is not None:
                self.on_polling(None, POLL_SECONDS)
        metrics.WATCH_POLLING.set(0 if self.reason is None else 1)


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
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _root_state(path: str) -> tuple[int, int, bool] | None:
    """A root's :func:`_identity` and whether this process can open it; None when it is no
    directory. Readability is part of it: a root that becomes readable again (permissions fixed,
    a stale mount answering again: no inotify event reaches a root that was never watched) is a
    root changed, rescanned at once, not at the next periodic reconcile."""
    ident = _identity(path)
    if ident is None:
        return None
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    except OSError:
        return (*ident, False)
    return (*ident, True)


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def real_dirs(tops: list[str]) -> dict[str, tuple[int, int]]:
    """The directories to watch under ``tops``: path → (st_dev, st_ino).

    ``tops`` themselves are followed if they are symlinks; below them no symlink is followed, and
    each directory is taken once (a bind mount of one of them further down is not walked again).
    Left out: directories this process cannot read (no watch could be added either) and names
    that are not UTF-8 (never mirrored; the engine takes ``str`` paths)."""
    out: dict[str, tuple[int, int]] = {}
    seen: set[tuple[int, int]] = set()
    stack: list[tuple[str, tuple[int, int]]] = []
    for top in reversed(tops):
        ident = _identity(top)
        if ident is not None:
            stack.append((top, ident))
    while stack:
        path, ident = stack.pop()
        if ident in seen or not os.access(path, os.R_OK):
            continue
        seen.add(ident)
        out[path] = ident
        try:
            with os.scandir(path) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False) and _utf8(entry.name):
                            st = entry.stat(follow_symlinks=False)
                            stack.append((entry.path, (st.st_dev, st.st_ino)))
                    except OSError:
                        continue  # vanished or not stat-able: not watched
        except OSError:
            continue
    return out


def _engine(dirs: list[str], ignore_errors: bool = False) -> RustNotify:
    """One inotify instance with a non-recursive watch on each of ``dirs``. Raises
    :class:`WatchLimit`, or FileNotFoundError/PermissionError for a directory that went or
    turned unreadable since the walk (``ignore_errors`` skips those, and every other failed watch)."""
    try:
        return RustNotify(dirs, False, False, 300, False, ignore_errors)
    except Exception as e:
        limit = _as_limit(e)
        if limit is not None:
            raise limit from e
        raise


class _Watch:
    """The engine being pumped (``notify``), the one built to replace it (``next``, swapped in
    by the pump at its next batch) and the directories the newest one watches (``dirs``)."""

    def __init__(self, present: list[str]) -> None:
        self.present = present
        self.notify: RustNotify | None = None
        self.next: RustNotify | None = None
        self.dirs: dict[str, tuple[int, int]] = {}
        #: the directories the pumped engine (``notify``) watches
        self.pumped: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            engines, self.notify, self.next = (self.notify, self.next), None, None
        for e in engines:
            if e is not None:
                e.close()

    def build(self) -> list[str]:
        """Walk the roots and make an engine watching every directory found: ``notify`` when
        there is none yet, else ``next`` (the running one keeps watching until the pump swaps).
        Directories that appeared inside new ones during the build get another round. Returns
        the directories that are new since the last build, and those of a ``next`` this build
        replaced before it was pumped (what it saw is lost with it): the caller scans them.
        Raises :class:`WatchLimit`."""
        added: list[str] = []
        for _ in range(GROW_ROUNDS):
            known = set(self.dirs.values())
            dirs = real_dirs(self.present)
            for attempt in range(3):
                try:
                    # the last attempt skips what still fails (and so a limit too): best effort
                    notify = _engine(list(dirs), ignore_errors=attempt == 2)
                    break
                except (FileNotFoundError, PermissionError):
                    dirs = real_dirs(self.present)  # the tree changed under the walk: walk again
            with self._lock:
                superseded = None
                if self.notify is None:
                    self.notify = notify
                    self.pumped = set(dirs.values())
                else:
                    superseded, self.next = self.next, notify
                    if superseded is not None:
                        # Never pumped: the events it queued go with it, so the directories only it
                        # watched are new again, to be scanned once this engine watches them.
                        added.extend(p for p, ident in self.dirs.items() if ident not in self.pumped)
                self.dirs = dirs
            if superseded is not None:
                superseded.close()
            new = [p for p, ident in dirs.items() if ident not in known]
            added.extend(new)
            watched = set(dirs.values())
            if all(ident in watched for ident in real_dirs(new).values()):
                break
        return list(dict.fromkeys(added))

    def swap(self) -> set[tuple[int, str]] | None:
        """Pump ``next`` from now on; returns what the old engine saw since its last batch."""
        with self._lock:
            old, self.notify, self.next = self.notify, self.next, None
            self.pumped = set(self.dirs.values())
        assert old is not None  # swapped only while one is running
        try:
            drained = old.watch(0, 1, 1, None)
        except Exception:  # the old watch broke (an undecodable name): the new one is in place
            drained = None
        old.close()
        return drained if isinstance(drained, set) else None


class _Grow:
    """Set when a batch brought directories the watch does not cover."""

    def __init__(self) -> None:
        self.wanted = anyio.Event()


def _new_dirs(raw: set[tuple[int, str]], dirs: dict[str, tuple[int, int]]) -> list[str]:
    """The directories added in the batch ``raw`` that ``dirs`` does not watch at that path with
    that identity (a directory deleted and made again in one batch may reuse its inode number)."""
    out = []
    for change, path in raw:
        if change != ADDED:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and (dirs.get(path) != (st.st_dev, st.st_ino) or (DELETED, path) in raw):
            out.append(path)
    return out


async def watch(
    roots: list[Root],
    on_paths: Callable[[list[str]], Awaitable[None]],
    on_roots_changed: Callable[[list[Root]], Awaitable[None]],
    *,
    debounce_ms: int = 25,
    on_polling: Callable[[str | None, float], None] | None = None,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run until cancelled. Signals ``task_status.started()`` once the first watch is in place,
    or polling has begun (an inotify limit used up). Never ends on a used-up limit.
    ``on_polling`` is told when polling begins (why, and its step in seconds) and ends (None)."""
    polling = _Polling(on_polling)
    started = False
    rescan: list[Root] = []
    overflow = _Overflow()
    while True:
        ids = {r.path: _root_state(r.path) for r in roots}
        present = [r.path for r in roots if ids[r.path] is not None]
        stop = threading.Event()
        w = _Watch(present)
        limit: str | None = None
        if present:
            try:
                overflow.armed(_queue_limit())
                await anyio.to_thread.run_sync(w.build)
            except WatchLimit as e:
                limit = str(e)
            except Exception as e:  # anything else the engine refuses: polled too, never fatal
                log.warning("watch_setup_failed", exc=e)
                limit = f"the watch could not be set up: {e}"
        polling.set(limit)
        log.debug("watching", roots=",".join(present) or "-", watches=len(w.dirs))
        if not started:
            task_status.started()
            started = True
        if limit is not None:
            w.close()  # a build that failed after its first round holds an engine
            await _poll(roots, on_roots_changed)
            rescan = list(roots)  # for when inotify watches again: changes since the last rescan
            continue
        if rescan:  # only now that the new watch is in place, so nothing falls between the two
            log.info("roots_changed", roots=",".join(r.path for r in rescan))
            # Every root is rescanned, not only those that changed: the other roots' events not yet
            # handed over went with the old watch, and nothing watched them until the new one.
            await on_roots_changed(list(roots))
            rescan = []
        try:
            changed = await _watch_once(roots, ids, w, stop, on_paths, debounce_ms, overflow)
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
            w.close()
        rescan = changed


async def _poll(roots: list[Root], on_roots_changed: Callable[[list[Root]], Awaitable[None]]) -> None:
    """Rescan every root each :data:`POLL_SECONDS` for :data:`POLL_RETRY_SECONDS`."""
    deadline = time.monotonic() + POLL_RETRY_SECONDS
    while time.monotonic() < deadline:
        try:
            await on_roots_changed(list(roots))
        except Exception as e:  # a failed rescan is retried at the next step; never ends the watcher
            log.warning("watch_poll_failed", exc=e)
        await anyio.sleep(POLL_SECONDS)


async def _watch_once(roots: list[Root], ids: dict[str, tuple[int, int, bool] | None], w: _Watch, stop: threading.Event,
                      on_paths: Callable[[list[str]], Awaitable[None]], debounce_ms: int,
                      overflow: _Overflow | None = None) -> list[Root]:
    """Pump events until a root appears, disappears or is replaced, the queue may have
    overflowed, or a limit is met while adding directories; returns the roots to rescan once
    the watch is rebuilt."""
    changed: list[Root] = []
    overflow = overflow or _Overflow()

    def rebuild_all() -> None:
        changed.extend(r for r in roots if ids[r.path] is not None and r not in changed)
        tg.cancel_scope.cancel()

    def overflowed() -> None:
        log.warning("watch_overflow_suspected", changes=overflow.rescanned(), queue=overflow.queue,
                    detail="a burst that may have overflowed the inotify queue: watch rebuilt, roots rescanned")
        rebuild_all()

    async with anyio.create_task_group() as tg:

        async def poll_roots() -> None:
            # quick while a root is missing or unreadable; existing roots report their own removal
            interval = ROOT_POLL_SECONDS if any(i is None or not i[2] for i in ids.values()) else 4 * ROOT_POLL_SECONDS
            while True:
                await anyio.sleep(interval)
                now = [r for r in roots if _root_state(r.path) != ids[r.path]]
                if now:
                    changed.extend(now)
                    tg.cancel_scope.cancel()
                    return
                if overflow.due():  # owed from a burst during the cooldown
                    overflowed()
                    return

        async def on_batch(raw: set[tuple[int, str]]) -> None:
            paths = [path for _change, path in raw]
            # A root itself reported (removed or replaced): its inotify watch is dead even if a new
            # directory reuses the inode number, so rebuild the watch.
            hit = [r for r in roots if r.path in paths]
            await on_paths(paths)
            if hit:
                changed.extend(hit)
                tg.cancel_scope.cancel()
            elif overflow.note(len(paths)):
                overflowed()
            elif _new_dirs(raw, w.dirs):
                grow.wanted.set()

        async def grower() -> None:
            # Rebuilds for new directories, spaced: the engine holds the GIL while it adds its
            # watches (~25 µs a directory), so a burst of new directories costs a bounded share of
            # the time. Files in a directory not yet watched are found by the uploader's scan of
            # the directory hint, and again once it is watched.
            cost, done = 0.0, float("-inf")
            while True:
                await grow.wanted.wait()
                grow.wanted = anyio.Event()
                await anyio.sleep(max(0.0, done + GROW_SPACING * cost - time.monotonic()))
                t0 = time.perf_counter()
                try:
                    new = await anyio.to_thread.run_sync(w.build)
                except WatchLimit as e:
                    # the running engine's watches count too: rebuild with it closed
                    log.info("watch_rebuild_at_limit", reason=str(e))
                    rebuild_all()
                    return
                cost, done = time.perf_counter() - t0, time.monotonic()
                overflow.armed(_queue_limit())
                log.debug("watch_grown", watches=len(w.dirs), new=len(new), ms=round(cost * 1000, 1))
                if new:
                    await on_paths(new)  # the uploader scans them: files written before their watch

        grow = _Grow()
        tg.start_soon(poll_roots)
        if w.notify is not None:
            tg.start_soon(grower)
            tg.start_soon(_pump, w, stop, on_batch, debounce_ms)
    return changed


#: polling step while writes are coming (ms): the added latency of a write in a busy period
ACTIVE_STEP_MS = 2
#: how long a period stays busy after its last event (s)
ACTIVE_SECONDS = 3.0


async def _pump(w: _Watch, stop: threading.Event, on_batch: Callable[[set[tuple[int, str]]], Awaitable[None]],
                idle_step_ms: int) -> None:
    """Hand event batches (sets of ``(change, path)``) over as soon as they arrive, from whichever
    engine ``w`` holds at the time.

    watchfiles' engine checks for events every ``step`` ms, a thread wake-up and the GIL each
    time, which a short step pays for with idle CPU. So the step is ``idle_step_ms``
    (SIDECAR_DEBOUNCE_MS) while idle and 2 ms for a few seconds after any event: the first write
    after a quiet spell waits half the idle step on average, the writes of a busy turn 1 ms.
    ``debounce=0`` returns a batch at the first check that sees one (coalescing happens later).
    """
    active_until = 0.0
    while True:
        if w.next is not None:  # a rebuilt engine is ready: hand over what the old one saw last
            drained = await anyio.to_thread.run_sync(w.swap)
            if drained:
                metrics.WATCH_EVENTS.inc(len(drained))
                await on_batch(drained)
        step = ACTIVE_STEP_MS if time.monotonic() < active_until else max(ACTIVE_STEP_MS, idle_step_ms)
        assert w.notify is not None  # built before the pump starts, swapped, never cleared while it runs
        raw = await anyio.to_thread.run_sync(w.notify.watch, 0, step, 1000, stop, abandon_on_cancel=True)
        if raw == "stop":
            return
        if isinstance(raw, str):  # "timeout", "signal"
            continue
        active_until = time.monotonic() + ACTIVE_SECONDS
        metrics.WATCH_EVENTS.inc(len(raw))
        await on_batch(raw)
