"""The life of a command, start to stop: what starts it, what ends it, and its exit code.

``sync`` and ``run -- CMD`` are one :class:`Lifecycle`; its steps, in the order they run::

    open_store    the store client (a store URL or credentials it cannot use, or on a container platform
                  a directory store that is not there: StoreConfigError, exit 2)
    serve_http    /livez /readyz /metrics when SIDECAR_HTTP_ADDR is set (cannot listen: exit 1)
    restore       Daemon.prepare by the restore rule (refused: exit 2; failed: exit 1)
    spawn_child   run only: CMD, as soon as its state is in place (cannot start: 127 or 126)
    mirror        Daemon.serve: fence, upload workers, watcher, first reconcile (sync logs ready);
                  the legacy-state hint
    wait_for_end  sync: a shutdown request; run: the child's exit, then its leftover helpers'
                  (fenced: the child is stopped, exit 75)
    drain         Daemon.drain: shielded, bounded by SIDECAR_DRAIN_TIMEOUT, abandoned by a second signal
    close         a child still running is stopped (SIGTERM, 5 s, SIGKILL); the store is closed

A step that returns an exit code ends the command there (its one-line error already written),
and only ``close`` runs after it. What ends a command that got through its start:

* ``sync`` ends when :class:`Shutdown` is triggered: by SIGTERM or SIGINT, handled from the
  start, or directly (tests inject their own). Exit 0 when the drain flushed everything, 75 when
  changes were left pending. A stop during the restore cancels it: exit 1, nothing to flush.
* ``run`` ends when its child exits, and exits with the child's code whatever the drain leaves;
  once fenced by a newer sidecar it stops the child itself (SIGTERM, the stop grace, SIGKILL)
  and exits 75 (:data:`EXIT_FENCED`). Signals are handled only once the child exists: each is
  forwarded to it (SIGHUP too), and its exit is what ends the wrapper. Before that they keep
  Python's default action (SIGTERM ends the wrapper at once; SIGINT is a KeyboardInterrupt, exit
  130). A failed restore means the child never starts; once it has started, its helpers left
  running are ended before the drain.

The first SIGTERM/SIGINT asks for a graceful stop (drain, bounded by ``drain_timeout``); a second
one forces it (the flush wait is abandoned), as uvicorn and hypercorn do.

The one-shot ``restore`` (:func:`restore`) shares ``open_store`` and the restore step, and
then gives the legacy-state hint (:func:`~sidecar.storeclient.report_legacy_state`) as ``mirror``
does.
Everything beyond anyio and the logger is imported where it is first needed: ``run`` starts its
child before anything only mirroring needs is loaded.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Callable

import anyio
from anyio.abc import TaskGroup

from sidecar import log
from sidecar.errors import EXIT_CONFIG, EXIT_FAIL, EXIT_OK, EXIT_PENDING, fail
from sidecar.storeclient import missing, open_store, report_legacy_state, say_if_missing

if TYPE_CHECKING:
    from sidecar.config import Settings
    from sidecar.daemon import Daemon
    from sidecar.paths import Root
    from sidecar.points.plan import AsOf
    from sidecar.runner import Child
    from sidecar.store.base import Store

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

#: Seconds ``close`` gives a child still running after SIGTERM before it sends SIGKILL.
CHILD_CLOSE_GRACE = 5

#: ``run``'s code once fenced (a newer sidecar owns the namespace; its child was stopped): the
#: code ``sync`` ends with when its changes were not stored.
EXIT_FENCED = EXIT_PENDING


class Shutdown:
    """The shutdown trigger: signals pull it in production, tests call :meth:`trigger` directly.

    ``requested`` is set by the first trigger (stop gracefully: drain), ``forced`` by the second
    (stop now: abandon the drain's wait).
    """

    def __init__(self) -> None:
        self.requested = anyio.Event()
        self.forced = anyio.Event()

    def trigger(self, reason: str = "requested") -> None:
        """Request a shutdown (logged as ``shutdown_requested``); once requested, force it
        (``shutdown_forced``, logged once)."""
        if self.requested.is_set():
            if not self.forced.is_set():
                log.warning("shutdown_forced", reason=reason)
            self.forced.set()
        else:
            log.info("shutdown_requested", reason=reason)
            self.requested.set()


async def handle_signals(shutdown: Shutdown, forward: Callable[[int], None] | None) -> None:
    """Turn SIGTERM/SIGINT into shutdown triggers until cancelled. With ``forward`` (a child's
    ``send``), every signal, SIGHUP included, is passed to it first."""
    sigs = STOP_SIGNALS + ((signal.SIGHUP,) if forward is not None else ())
    with anyio.open_signal_receiver(*sigs) as received:
        async for sig in received:
            if forward is not None:
                forward(sig)
            if sig in STOP_SIGNALS:
                shutdown.trigger(signal.Signals(sig).name)


async def prepare(daemon: Daemon, settings: Settings) -> int | None:
    """Restore by the rule (:meth:`~sidecar.daemon.Daemon.prepare`, which only reads the store).
    Returns an exit code, its error line written, when the command must stop; None to go on,
    which includes an unreachable store with ``SIDECAR_RESTORE_OPTIONAL``."""
    from sidecar.fence import IdentityConflict
    from sidecar.health import RestorePhase
    from sidecar.restore.latest import ForeignDisk, RestoreError
    from sidecar.store.base import StoreError

    try:
        await daemon.prepare()
    except (IdentityConflict, ForeignDisk) as e:
        return fail(f"refusing to start: {e}", EXIT_CONFIG)
    except RestoreError as e:
        return fail(f"restore failed: {e}")
    except StoreError as e:
        if settings.restore_optional:
            daemon.health.restore_phase(RestorePhase.UNREACHABLE)
            log.error("store_unreachable_starting_anyway", error=str(e))
            return None
        return fail(f"cannot reach the store: {e} (refusing to start without the saved state; "
                    "SIDECAR_RESTORE_OPTIONAL=true starts anyway)")
    return None


class Lifecycle:
    """One ``sync`` (``cmd`` None) or one ``run -- CMD`` (``cmd`` the command), start to stop.

    :meth:`main` runs the steps of the module's docstring in order and returns the exit code.
    ``shutdown`` is the trigger that stops it (a new one when None); the steps are methods so
    that each can be read, and replaced in a test, on its own. Not reusable: one instance, one run.
    """

    store: Store
    daemon: Daemon

    def __init__(self, settings: Settings, roots: list[Root], cmd: list[str] | None = None,
                 shutdown: Shutdown | None = None) -> None:
        self.settings = settings
        self.roots = roots
        self.cmd = cmd
        self.shutdown = shutdown if shutdown is not None else Shutdown()
        self.child: Child | None = None

    @property
    def wraps_child(self) -> bool:
        """Whether this is ``run`` (a child to start and wait for) rather than ``sync``."""
        return self.cmd is not None

    async def main(self) -> int:
        """Run the whole lifecycle; the exit code."""
        from sidecar.daemon import Daemon

        self.store = self.open_store()
        try:
            self.daemon = Daemon(self.settings, self.roots, self.store)
            async with anyio.create_task_group() as tg:
                code = await self._steps(tg)
                tg.cancel_scope.cancel()  # the listener, the mirror and the signal handler
            return code
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()

    async def _steps(self, tg: TaskGroup) -> int:
        """Steps 2 to 7, the long-lived ones in ``tg``; the exit code."""
        if (code := await self.start(tg)) is not None:
            return code
        child_code = await self.wait_for_end()
        left = await self.drain()
        if child_code is not None:  # run: the child's own code, whatever the drain left
            return child_code
        return EXIT_OK if left == 0 else EXIT_PENDING  # sync: whether everything was flushed

    def open_store(self) -> Store:
        """Step 1: the store client (:func:`open_store`)."""
        return open_store(self.settings, roots=self.roots)

    async def start(self, tg: TaskGroup) -> int | None:
        """Steps 2 to 5, each in ``tg``: None once mirroring, or the exit code to stop with."""
        if not self.wraps_child:
            # sync: signals are stop requests from the start (run: from its child's start)
            tg.start_soon(handle_signals, self.shutdown, None)
        if (code := await self.serve_http(tg)) is not None:
            return code
        if (code := await self.restore(tg)) is not None:
            return code
        if self.wraps_child and (code := await self.spawn_child(tg)) is not None:
            return code
        await self.mirror(tg)
        return None

    async def serve_http(self, tg: TaskGroup) -> int | None:
        """Step 2: start the health/metrics listener when an address is set; an exit code when it
        cannot listen."""
        if self.settings.http_host_port() is None:
            return None
        from sidecar.http import HttpBindError, serve

        try:
            await tg.start(serve, self.settings, self.daemon.health)
        except HttpBindError as e:
            return fail(str(e))
        return None

    async def restore(self, tg: TaskGroup) -> int | None:
        """Step 3: restore by the rule (:func:`prepare`); an exit code when the command must stop."""
        if self.wraps_child:
            # run: nothing stops the restore (its signals are not handled before the child starts)
            return await prepare(self.daemon, self.settings)
        # sync: a stop during the restore ends it at once, exit 1: nothing has been mirrored yet
        with anyio.CancelScope() as scope:
            tg.start_soon(_cancel_on, self.shutdown.requested, scope)
            code = await prepare(self.daemon, self.settings)
        return EXIT_FAIL if scope.cancelled_caught else code

    async def spawn_child(self, tg: TaskGroup) -> int | None:
        """Step 4 (run): start the command as soon as its state is in place, before the mirror
        (the first reconcile, made once the watch is in place, queues anything the child wrote
        in between, so mirroring adds nothing to its start-up time). From then on every signal
        goes to the child. An exit code (127, 126) when it cannot start."""
        from sidecar.runner import Child, SpawnError

        assert self.cmd is not None
        try:
            self.child = await Child.spawn(self.cmd, grace=self.settings.child_stop_grace)
        except SpawnError as e:
            return fail(str(e), e.exit_code)
        log.info("child_started", pid=self.child.pid, cmd=self.cmd[0])
        tg.start_soon(handle_signals, self.shutdown, self.child.send)
        return None

    async def mirror(self, tg: TaskGroup) -> None:
        """Step 5: start mirroring (:meth:`~sidecar.daemon.Daemon.serve`); returns once the watch
        is in place and the first reconcile is planned. A stop requested meanwhile still drains
        what that reconcile queued (what the host wrote since the restore). Then, as after the
        one-shot restore, the legacy-state hint (:func:`~sidecar.storeclient.report_legacy_state`)."""
        await tg.start(self.daemon.serve)
        if not self.wraps_child:  # the ``ready`` event is sync's; run's start is ``child_started``
            log.info("ready", roots=",".join(r.path for r in self.roots), store=self.store.description)
        tg.start_soon(report_legacy_state, self.settings, self.roots, self.daemon.startup.namespace_empty)

    async def wait_for_end(self) -> int | None:
        """Step 6: wait for what ends the command. sync: a shutdown request (None). run: the
        child's exit (its code), then the end of the helpers it left in its process group, so
        that what they write as they stop is drained too. A fenced ``run`` stops its child
        (SIGTERM, then SIGKILL after the stop grace) and returns :data:`EXIT_FENCED`: a host whose
        writes can no longer be stored must not go on serving."""
        if self.child is None:
            await self.shutdown.requested.wait()
            return None
        child = self.child
        fenced = False

        async def stop_when_fenced() -> None:
            nonlocal fenced
            await self.daemon.fenced.wait()
            fenced = True
            log.error("child_stopped_fenced", pid=child.pid, grace_seconds=child.grace,
                      detail="a newer sidecar owns this namespace, so nothing this compute writes can be stored "
                             "any more: the host is stopped (SIGTERM, then SIGKILL after SIDECAR_CHILD_STOP_GRACE) "
                             f"and the wrapper exits {EXIT_FENCED}")
            child.send(signal.SIGTERM)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_when_fenced)
            rc = await child.wait()
            tg.cancel_scope.cancel()
        log.info("child_exited", code=rc)
        await child.end_group()
        return EXIT_FENCED if fenced else rc

    async def drain(self) -> int:
        """Step 7: flush what is pending, shielded from cancellation, bounded by
        ``drain_timeout`` and abandoned by a forced shutdown; how many paths were left."""
        with anyio.CancelScope(shield=True):
            left = await self.daemon.drain(self.settings.drain_timeout, abandon=self.shutdown.forced)
        return left

    async def close(self) -> None:
        """Step 8, whatever ended the command: stop a child still running (SIGTERM, then SIGKILL
        after :data:`CHILD_CLOSE_GRACE` seconds), close the store."""
        child = self.child
        if child is not None and child.proc.returncode is None:
            child.send(signal.SIGTERM)
            with anyio.move_on_after(CHILD_CLOSE_GRACE):
                await child.wait()
            child.send(signal.SIGKILL)
        await self.store.aclose()


async def _cancel_on(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def sync(settings: Settings, roots: list[Root], shutdown: Shutdown | None = None) -> int:
    """``checkpoint-sidecar sync``: restore, mirror until shut down, drain. Exit 0, 75 when changes
    were left pending, 1 or 2 when it cannot start (see :class:`Lifecycle`)."""
    return await Lifecycle(settings, roots, shutdown=shutdown).main()


async def run(settings: Settings, roots: list[Root], cmd: list[str], shutdown: Shutdown | None = None) -> int:
    """``checkpoint-sidecar run -- CMD``: restore, start ``cmd``, mirror until it exits, drain.
    The child's exit code; 1 or 2 when the restore fails (``cmd`` never starts), 127 or 126 when
    ``cmd`` cannot start (see :class:`Lifecycle`)."""
    return await Lifecycle(settings, roots, cmd=cmd, shutdown=shutdown).main()


async def restore(settings: Settings, roots: list[Root], as_of: AsOf | None = None) -> int:
    """``checkpoint-sidecar restore``: the restore step alone, then a hint when the state is where
    a release without namespaces kept it. Reads only: the store is claimed by a mirror, never here.
    Exit 0 once the state is on disk (or nothing was stored), 1 or 2 as :func:`prepare` says.
    ``as_of`` (``--as-of``: a store time, seconds ago, or a point's seq): the namespace as it was
    then, from its restore points (:func:`restore_as_of`)."""
    from sidecar.daemon import Daemon

    store = open_store(settings, read_only=True, roots=roots)  # a missing store (or container) is not created
    try:
        if as_of is not None:
            return await restore_as_of(settings, roots, store, as_of)
        # reads only (a prune deleting the namespace is still waited for)
        daemon = Daemon(settings, roots, store, takes_over=False)
        code = await prepare(daemon, settings)
        if code is None and daemon.startup.namespace_empty:
            await say_if_missing(store)
        if code is None:
            await report_legacy_state(settings, roots, daemon.startup.namespace_empty)
        return EXIT_OK if code is None else code
    finally:
        await store.aclose()


async def restore_as_of(settings: Settings, roots: list[Root], store: Store, as_of: AsOf) -> int:
    """``restore --as-of``: fill the roots with the namespace as it was at ``as_of`` (a store time,
    seconds before the store's now, or a point's seq) from its restore points (:mod:`sidecar.restore.asof`). Reads
    only: neither claims the namespace nor writes to the store. With ``--force-restore`` each root
    is made equal to the point: what differs is moved beside the root, one line per root says
    how many entries, which and where (:func:`~sidecar.restore.asof.aside_line`). Exit 0 once filled; 1 when
    no point is at or before the time, a root holds files (without ``--force-restore``), what the
    point lacks cannot be moved aside, a point is unreadable or the store cannot be read; 2 for
    another identity's namespace with ``--force-restore`` (into empty roots, without it, any
    identity may read it), a live owner with ``--force-restore`` or of roots recorded as its disk
    (:func:`_running`), or a root recorded as another namespace's disk (:func:`recorded_roots`)."""
    import time
    from functools import partial

    from sidecar.fence import IdentityConflict, take_for_restore
    from sidecar.restore.asof import AsOfError, aside_line, recorded_roots, rfc3339
    from sidecar.restore.asof import restore_as_of as fill
    from sidecar.restore.latest import ForeignDisk, check_foreign, lineage_of
    from sidecar.retry import STARTUP_RETRY_SECONDS, retry_transient
    from sidecar.store.base import StoreError

    ns = settings.namespace
    deadline = time.monotonic() + STARTUP_RETRY_SECONDS
    try:
        # --force-restore over another namespace's disk would record it as this one's, its files kept
        await check_foreign(roots, lineage_of(store, ns.path), settings.ignore_rules)
        await retry_transient(store.open, "open", deadline)
        if why := await missing(store):  # "no restore point" would hide a typo in SIDECAR_STORE
            return fail(f"restore --as-of failed: {why}")
        # (a prune deleting the namespace is waited for; nothing is written: take=False). Into
        # empty roots (no --force-restore) it only reads: another identity's namespace will do,
        # nothing of this compute is mixed into it (a sidecar started here later is checked)
        taken = await retry_transient(partial(take_for_restore, store, ns.identity, ns.path, take=False,
                                              store_url=settings.store, check=settings.restore == "force"),
                                      "read the owner marker", deadline)
        # roots another namespace's sidecar, or this one's live owner, may be mirroring: refused
        refusal, ours = await recorded_roots(roots, lineage_of(store, ns.path))
        if refusal is not None:
            return fail(f"refusing to restore --as-of: {refusal}", EXIT_CONFIG)
        if (settings.restore == "force" or ours) and (live := await retry_transient(
                partial(_running, store, settings.store, ns.path), "read the owner marker", deadline)):
            how = "with --force-restore" if settings.restore == "force" else "into roots recorded as its disk"
            return fail(f"refusing to restore --as-of {how}: {live}", EXIT_CONFIG)
        done = await fill(store, roots, as_of.when, as_of.ago, seq=as_of.seq, force=settings.restore == "force",
                          lineage=lineage_of(store, ns.path, taken.generation, marker=taken.lineage),
                          ignore=settings.ignore_rules,
                          deadline=deadline)
    except (IdentityConflict, ForeignDisk) as e:
        return fail(f"refusing to restore: {e}", EXIT_CONFIG)
    except AsOfError as e:
        return fail(f"restore --as-of failed: {e}")
    except StoreError as e:
        return fail(f"restore --as-of failed: cannot read the store: {e}")
    log.info("restore_as_of_done", point=done.point.key, point_time=rfc3339(done.time), files=done.files,
             bytes=done.bytes, refused=done.refused)
    print(f"checkpoint-sidecar: restored {log.count(done.files, 'file')} ({log.count(done.bytes, 'byte')}) as of the "
          f"restore point of {rfc3339(done.time)} (seq {done.point.seq})")
    for aside in done.aside:  # --force-restore: what differs from the point, moved beside the root
        print(f"checkpoint-sidecar: {aside_line(aside)}")
    return EXIT_OK


async def _held_live(store: Store, live_within: float, store_url: str, namespace: str) -> str | None:
    """Who holds the namespace live, and since when, in words, with the commands that go on
    from there, complete (None: no live owner): its marker judged by the store's clock, as
    ``sessions`` judges it (:func:`sidecar.ops.sessionplan.owner`); a prune deleting it counts too (a
    release would hand a half-deleted namespace to the next sidecar)."""
    from sidecar.fence import PRUNE_DELETING, marker_identity, prune_phase, read_marker_info
    from sidecar.marker import UNREADABLE
    from sidecar.namespace import command_for, describe_identity
    from sidecar.ops.sessionplan import LIVE, PRUNING, UNKNOWN, owner

    marker, info = await read_marker_info(store)
    if info is None:
        return None
    now = await store.now()
    who = owner(marker, info.modified, now, live_within)
    force = command_for("release --force", store_url, namespace)
    if who == PRUNING and prune_phase(marker) == PRUNE_DELETING:
        finish = command_for("prune --older-than 7d", store_url, namespace)
        return (f"a prune is deleting it (its marker says deleting, written {_ago(info.modified, now)}), and a "
                "release would hand the half-deleted namespace to the next sidecar: let that prune end, or, if "
                "none runs any more, finish it (a dead prune's namespace is finished whatever --older-than "
                f"says): {finish}; to release it half-deleted anyway: {force}")
    if who == UNKNOWN and info.modified is not None and now - info.modified < live_within:
        return (f"its marker cannot be read ({log.printable(str(marker.get(UNREADABLE)))}), yet it was written "
                f"{_ago(info.modified, now)} by the store's clock (within SIDECAR_LIVE_WITHIN={live_within:g}s): a running "
                "sidecar may hold it, and a release would fence it, losing what it has not stored yet: stop it first, or "
                f"wait until it is older than that; to fence whatever holds it and release now: {force}")
    if who != LIVE:
        return None
    held = log.printable(describe_identity(marker_identity(marker)))
    return (f"its owner is live: {held} holds it, its marker last written {_ago(info.modified, now)} by the store's "
            f"clock (live within SIDECAR_LIVE_WITHIN={live_within:g}s, or twice the heartbeat interval it records), "
            "and a release would fence that running sidecar, losing what it has not stored yet: stop it first, or "
            f"wait until it is no longer live; to fence it and release now: {force}")


async def _running(store: Store, store_url: str, namespace: str) -> str | None:
    """Why the namespace's roots may be a running session's disk, in words (None: its marker is
    released, stale or absent): the marker rewritten within twice the heartbeat interval it
    records, by the store's clock. An exact restore would move that host's files from under it,
    and its sidecar would mirror the moves."""
    from sidecar.fence import marker_identity, read_marker_info
    from sidecar.namespace import command_for, describe_identity
    from sidecar.ops.sessionplan import LIVE, owner

    marker, info = await read_marker_info(store)
    if info is None:
        return None
    now = await store.now()
    if owner(marker, info.modified, now, 0.0) != LIVE:
        return None
    held = log.printable(describe_identity(marker_identity(marker)))
    return (f"the namespace is live: {held} holds it, its marker last written {_ago(info.modified, now)} by the "
            "store's clock, and these roots may be that running session's disk: stop its host and sidecar first "
            "(a clean stop releases it); if they are gone without releasing it, release it: "
            f"{command_for('release --force', store_url, namespace)}")


def _ago(modified: float | None, now: float) -> str:
    """``at <RFC 3339 UTC>, N s ago`` for a store time."""
    if modified is None:
        return "at a time the store does not tell"
    return f"at {log.rfc3339(modified)}, {max(0, round(now - modified))} s ago"


async def release(settings: Settings, roots: list[Root], force: bool = False) -> int:
    """``checkpoint-sidecar release``: hand the namespace over to a sidecar of any identity
    (:func:`sidecar.fence.hand_over`), instead of deleting its owner marker. Creates nothing.
    A live owner (its marker rewritten within ``SIDECAR_LIVE_WITHIN``, or twice the heartbeat
    interval it records, by the store's clock: :func:`sidecar.ops.sessionplan.owner`, as ``sessions``
    tells it) is refused unless ``force``: the release would fence a running sidecar. Exit 0 once
    released (or when there is no marker), 1 when the store cannot be reached, 2 refused."""
    import time
    from functools import partial

    from sidecar.fence import hand_over
    from sidecar.namespace import describe_identity
    from sidecar.retry import STARTUP_RETRY_SECONDS, retry_transient
    from sidecar.store.base import StoreError

    del roots  # the namespace is the store's, whatever roots are configured
    # creates nothing; its clock is the store's own (a probe file on a directory store: it writes anyway)
    store = open_store(settings, read_only=True, writes=True)
    where = settings.namespace.path or "(top of the store)"
    deadline = time.monotonic() + STARTUP_RETRY_SECONDS
    try:
        await retry_transient(store.open, "open", deadline)
        if why := await missing(store):  # "nothing to release" would hide a typo in SIDECAR_STORE
            return fail(f"cannot release the namespace {where!r}: {why}")
        held = partial(_held_live, store, settings.live_within, settings.store, settings.namespace.path)
        if not force and (why := await retry_transient(held, "read the owner marker", deadline)):
            return fail(f"refusing to release the namespace {where!r} in {store.description}: {why}", EXIT_CONFIG)
        done = await retry_transient(partial(hand_over, store), "release the owner marker", deadline)
    except StoreError as e:
        return fail(f"cannot release the namespace {where!r} in {store.description}: {e}")
    finally:
        await store.aclose()
    if done is None:
        print(f"checkpoint-sidecar: nothing to release: the namespace {where!r} in {store.description} has no "
              "owner marker (any sidecar may claim it)")
        return EXIT_OK
    log.info("namespace_released", namespace=where, previous_identity=describe_identity(done.identity),
             generation=done.generation, owner_held_it=done.held)
    line = (f"checkpoint-sidecar: released the namespace {where!r} in {store.description} "
            f"(owned by {describe_identity(done.identity)}): a sidecar of any identity may claim it now")
    if done.held:
        line += ("; its owner had not released it: if that sidecar still runs it is fenced at its next write, "
                 "and the next claim waits out its write window")
    print(line)
    return EXIT_OK
