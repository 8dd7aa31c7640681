"""``checkpoint-sidecar prune --older-than DURATION [--dry-run] [--live-within DURATION]
[--pushgateway URL]``: delete whole namespaces whose session ended.

Every namespace of the store is listed as ``sessions`` lists it (:func:`sidecar.ops.namespaces.walk`);
one is eligible when its owner is not live (released, stale, or no marker) and its last write is
at least ``--older-than`` old, both by the store's clock (:func:`sidecar.ops.sessionplan.prunable`);
``--older-than 0s`` prunes every ended one. Each eligible namespace is pruned by
:class:`sidecar.ops.pruner.Pruner` (the owner-marker protocol that keeps a namespace claimed
meanwhile whole), :data:`PARALLEL` at once. One line per eligible namespace on stdout, one
summary line; progress on stderr when it is a terminal. ``--pushgateway``: the gauges of
:data:`GAUGES`, pushed once at the end.

``SIDECAR_PREFIX`` is resolved as if no session were named (:func:`sidecar.ops.namespaces.operator_prefix`):
``FOUNDRY_AGENT_SESSION_ID`` in the environment never narrows prune to one session; when it is
set, one line on stderr says so and names the prefix pruned. A dry run only reads (a read-only
store will do).

Durations carry their unit (:data:`sidecar.configtypes.UnitSeconds`: ``--older-than 7`` is
refused, not seven seconds), and ``--older-than`` below :data:`FLOOR` needs ``--force``. A
failure is one namespace's (:meth:`sidecar.ops.pruner.Pruner.prune` never raises): one ``failed``
line, the others go on.

Exit codes (as ``prune --help`` says): 0 done (nothing eligible included); 1 the store cannot be
listed (the directory or the container does not exist, too), or the push failed; 2 bad usage or
configuration (a duration without its unit, ``--older-than`` below the floor without
``--force``); 3 some eligible namespaces could not be pruned, or were refused because they hold
what prune cannot delete (the others were; run it again)."""

from __future__ import annotations

import sys
import time
from functools import partial
from typing import Callable

import anyio
import anyio.abc
import anyio.to_thread

from sidecar import log
from sidecar.config import Settings
from sidecar.errors import EXIT_CONFIG, EXIT_FAIL, EXIT_OK, EXIT_PARTIAL, fail
from sidecar.namespace import command_for
from sidecar.ops.namespaces import Namespace, StoreClock, full_name, namespace_store, start_operator, walk
from sidecar.ops.pruner import FAILED, PRUNED, SKIPPED, WOULD_PRUNE, Pruner, Result
from sidecar.ops.sessionplan import prunable
from sidecar.store.base import Store, StoreError
from sidecar.storeclient import missing, open_store, store_at

#: The store itself (the directory, the container) is not there: nothing can be listed.
EXIT_MISSING = EXIT_FAIL
#: The least --older-than taken without --force (seconds): below it prune would delete sessions
#: merely idle (released minutes after their last turn on Foundry).
FLOOR = 3600.0
#: Namespaces pruned at once (each waits a grace of SIDECAR_FENCE_WINDOW + SIDECAR_FENCE_MARGIN).
PARALLEL = 16
#: The gauges pushed to --pushgateway (alert rules use these names).
GAUGES = {
    "checkpoint_sidecar_prune_eligible_namespaces": "namespaces the last prune found eligible",
    "checkpoint_sidecar_prune_pruned_namespaces": "namespaces the last prune deleted",
    "checkpoint_sidecar_prune_last_success_timestamp_seconds": "when a prune last ended with every eligible "
                                                               "namespace pruned (unix time)",
}
JOB = "checkpoint_sidecar_prune"
#: Back to the start of the terminal's line, and erase it.
CLEAR_LINE = "\r\x1b[K"


class Tally:
    """The counts of one run, and its progress line."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        self.listed = self.eligible = self.kept = 0
        self.by: dict[str, int] = {PRUNED: 0, WOULD_PRUNE: 0, SKIPPED: 0, FAILED: 0}
        self.objects = self.bytes = 0
        self.tty = sys.stderr.isatty()
        #: why stdout took no more lines (a closed pipe, a full disk): the prune goes on to its end
        self.output_lost: str | None = None

    def add(self, r: Result) -> None:
        self.by[r.outcome] += 1
        if r.outcome in (PRUNED, WOULD_PRUNE):
            self.objects += r.objects
            self.bytes += r.bytes

    def progress(self) -> None:
        """The progress line on stderr, on a terminal only, redrawn in place."""
        if self.tty:
            done = self.by[PRUNED] + self.by[WOULD_PRUNE]
            print(f"{CLEAR_LINE}{log.count(self.listed, 'namespace')} listed, {self.eligible} eligible, {done} "
                  f"{'would be pruned' if self.dry_run else 'pruned'}", end="", file=sys.stderr, flush=True)

    def say(self, text: str) -> None:
        """A line on stdout. On a terminal the progress line shares the screen: it is cleared
        first, so the line starts at its own beginning, and drawn again below it."""
        if self.tty:
            print(CLEAR_LINE, end="", file=sys.stderr, flush=True)
        self.out(text)
        self.progress()

    def out(self, text: str) -> None:
        """A line on stdout, unless stdout was lost: then nothing (the prune is not cut short, a
        namespace is never left half-deleted by a reader that went away)."""
        if self.output_lost is not None:
            return
        try:
            print(text, flush=True)
        except OSError as e:
            self.output_lost = e.strerror or type(e).__name__

    def summary(self) -> str:
        if self.tty:
            print(CLEAR_LINE, end="", file=sys.stderr, flush=True)  # the summary says it all
        done = self.by[WOULD_PRUNE] if self.dry_run else self.by[PRUNED]
        verb = "would prune" if self.dry_run else "pruned"
        return (f"prune: {verb} {log.count(done, 'namespace')} ({log.count(self.objects, 'object')}, "
                f"{log.count(self.bytes, 'byte')}); kept {self.kept} (live, or written too recently); skipped "
                f"{self.by[SKIPPED]} (claimed or changed meanwhile: every object kept); failed {self.by[FAILED]}"
                f"{' (dry run: nothing deleted)' if self.dry_run else ''}")


def line(r: Result, prefix: str) -> str:
    """The stdout line of one eligible namespace (its name escaped)."""
    name = log.printable(full_name(prefix, r.namespace) or "(top of the store)")
    if r.outcome in (PRUNED, WOULD_PRUNE):
        return f"{r.outcome} {name} ({log.count(r.objects, 'object')}, {log.count(r.bytes, 'byte')})"
    return f"{r.outcome} {name}: {log.printable(r.why)}"


async def command(settings: Settings, dry_run: bool, force: bool = False) -> int:
    """Prune (see the module docstring): ``settings.older_than``, ``live_within`` and
    ``pushgateway``; ``force`` lets ``older_than`` go below :data:`FLOOR`. The exit code."""
    older_than, live_within, pushgateway = settings.older_than, settings.live_within, settings.pushgateway
    if older_than is None:
        return fail("prune needs --older-than DURATION (SIDECAR_OLDER_THAN): how long a namespace's last write must "
                    "be past, with its unit, e.g. 7d", EXIT_CONFIG)
    started = start_operator(settings, "prune")
    if isinstance(started, int):
        return started
    settings = started
    prefix = settings.namespace.path
    if older_than < FLOOR and not force:
        shown = _shown_duration(older_than)
        again = command_for(f"prune --older-than {shown}{' --dry-run' if dry_run else ''} --force", settings.store,
                            prefix)
        return fail(f"--older-than {shown} is below {_shown_duration(FLOOR)}: it would delete sessions idle for "
                    f"less than that (a released session is only paused: on Foundry every idle session is released "
                    f"minutes after its last turn); if that is meant: {again}", EXIT_CONFIG)
    # creates nothing; a dry run writes nothing either (its clock is this machine's on a directory store,
    # said in one line), a real run makes its clock probe there like any write
    top = open_store(settings, read_only=True, writes=not dry_run)
    tally = Tally(dry_run)
    try:
        await top.open()
        if why := await missing(top):  # dry run or not: the same line, the same code
            return fail(f"{why} (its {_what(top)} does not exist): nothing was pruned", EXIT_MISSING)
        if (owner := await _enclosing_namespace(settings, prefix)) is not None:
            return fail(f"SIDECAR_PREFIX {log.printable(prefix)!r} lies inside the namespace {log.printable(owner)!r} "
                        f"(it has an owner marker): prune the namespaces under a prefix that holds them, never "
                        f"inside one", EXIT_CONFIG)
        clock = await StoreClock.of(top)
        if top.clock_is_local and not dry_run:
            return fail(f"cannot read the clock of {top.description} (no file can be made there): prune judges "
                        "ages by the store's clock only; run it with write access to the store")
        pruner = Pruner(partial(_store_for, settings, prefix), clock.now, settings.fence_window,
                        settings.fence_margin, older_than, live_within, dry_run)
        await _run(top, pruner, clock, tally, prefix)
    except StoreError as e:
        return fail(f"cannot list the namespaces of {top.description}: {e}")
    finally:
        await top.aclose()
    tally.out(summary := tally.summary())
    code = EXIT_PARTIAL if tally.by[FAILED] else EXIT_OK
    if pushgateway:
        try:
            await anyio.to_thread.run_sync(push, pushgateway, tally, code == EXIT_OK and not dry_run)
        except Exception as e:  # the gateway's answer or the connection: one line
            return fail(f"cannot push the prune's gauges to {log.redact(_without_userinfo(pushgateway))}: "
                        f"{type(e).__name__}: {log.redact(_without_userinfo(str(e)))}")
    if tally.output_lost is not None:
        return fail(f"cannot write the list: {tally.output_lost}; the prune went on to its end: {summary}")
    return code


def _shown_duration(seconds: float) -> str:
    """``seconds`` as a duration is written: ``1h``, ``30m``, ``90s``, ``1.5s``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _without_userinfo(text: str) -> str:
    """``text`` with the user name and password of any URL in it replaced by ``***``."""
    import re

    return re.sub(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]*@", r"\1***@", text)


async def _enclosing_namespace(settings: Settings, prefix: str) -> str | None:
    """The namespace ``prefix`` lies strictly inside (a prefix above it holds an owner marker),
    None when there is none: pruning inside a namespace would delete a live sidecar's files."""
    from sidecar.marker import OWNER_KEY
    from sidecar.store.base import NotFound

    parts = [p for p in prefix.split("/") if p]
    if not parts:
        return None
    root = store_at(settings, "", concurrency=1)
    try:
        for n in range(len(parts)):  # the top of the store, then each folder above the prefix
            above = "/".join(parts[:n])
            try:
                await root.get(f"{above}/{OWNER_KEY}" if above else OWNER_KEY)
            except NotFound:
                continue
            return above or "(top of the store)"
        return None
    finally:
        await root.aclose()


def _store_for(settings: Settings, prefix: str, namespace: str) -> Store:
    """A namespace's own store (:func:`~sidecar.ops.namespaces.namespace_store`). Opened read-only, dry
    run or not: opening it creates nothing, and the store still takes prune's writes (a dry run
    makes none, so a read-only mount or a SAS without write permission will do)."""
    return namespace_store(settings, prefix, namespace, concurrency=4)


def _what(store: Store) -> str:
    return "container" if getattr(store, "container_name", None) else "directory"


async def _run(top: Store, pruner: Pruner, clock: StoreClock, tally: Tally, prefix: str) -> None:
    """List and prune: the walk feeds :data:`PARALLEL` workers through a bounded stream."""
    send, receive = anyio.create_memory_object_stream[Namespace](PARALLEL)

    async def worker(queue: anyio.abc.ObjectReceiveStream[Namespace]) -> None:
        async with queue:
            async for ns in queue:
                r = await pruner.prune(ns)
                tally.add(r)
                tally.say(line(r, prefix))

    failed: list[StoreError] = []
    async with anyio.create_task_group() as tg:
        with receive:
            for _ in range(PARALLEL):
                tg.start_soon(worker, receive.clone())
        async with send:
            try:
                async for ns in walk(top, pruner.live_within, clock):
                    tally.listed += 1
                    g = ns.group
                    modified = g.marker.modified if g.marker is not None else None
                    if prunable(ns.owner, g.last_write, ns.marker, modified, clock.now(), pruner.older_than,
                                pruner.live_within, versions=False):  # the pruner decides again, versions known
                        tally.eligible += 1
                        await send.send(ns)
                    else:
                        tally.kept += 1
                    tally.progress()
            except StoreError as e:  # raised once the namespaces sent are done, not as a group
                failed.append(e)
    if failed:
        raise failed[0]


def push(url: str, tally: Tally, success: bool) -> None:
    """Push the gauges (prometheus-client's ``pushadd_to_gateway``: the last success time stays
    as it was when this run did not succeed)."""
    from prometheus_client import CollectorRegistry, Gauge, pushadd_to_gateway

    registry = CollectorRegistry()
    names = list(GAUGES)
    Gauge(names[0], GAUGES[names[0]], registry=registry).set(tally.eligible)
    Gauge(names[1], GAUGES[names[1]], registry=registry).set(tally.by[PRUNED])
    if success:
        Gauge(names[2], GAUGES[names[2]], registry=registry).set(time.time())
    gateway, handler = gateway_and_handler(url)
    pushadd_to_gateway(gateway, job=JOB, registry=registry, timeout=10, handler=handler)


def gateway_and_handler(url: str) -> tuple[str, Callable[..., Callable[[], None]]]:
    """The Pushgateway URL without a user and password, and the prometheus-client handler that
    pushes to it: HTTP basic auth with them when the URL carries them (urllib would take
    ``user:password@host`` for the host name), the default one otherwise."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    from prometheus_client.exposition import basic_auth_handler, default_handler

    parts = urlsplit(url if "://" in url else f"http://{url}")
    if "@" not in parts.netloc:
        return url, default_handler
    user, password = unquote(parts.username or ""), unquote(parts.password or "")

    def handler(url: str, method: str, timeout: float | None, headers: list[tuple[str, str]],
                data: bytes) -> Callable[[], None]:
        return basic_auth_handler(url, method, timeout, headers, data, username=user, password=password)

    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])), handler
