"""Command line: ``checkpoint-sidecar {restore,sync,run,status,probe}``.

Each command reads one validated :class:`~sidecar.config.Settings` (environment + flags) and then
reads top-down: open the store, restore, mirror, stop. Errors are one line on stderr and a
non-zero exit code, never a traceback:

    0  success (status: in sync)        2  bad configuration or usage
    1  runtime failure (store, restore)   75  stopped with changes still pending (sync)
    status: 1 when not in sync; run: the child's own code (128+N for signal N)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any

import anyio

from sidecar import __version__, log
from sidecar.config import ConfigError, Settings, load, unknown_variables
from sidecar.lifecycle import Shutdown, handle_signals
from sidecar.paths import Root

EXIT_OK, EXIT_FAIL, EXIT_CONFIG, EXIT_PENDING = 0, 1, 2, 75


def _flag_map() -> list[tuple[str, str, dict[str, Any]]]:
    return [
        ("--store", "store", {"help": "file:///dir, a path, or https://<account>.blob.core.windows.net/<container>[/<prefix>]"}),
        ("--layout", "layout", {"help": "agent-framework (default: .checkpoints,.function_approvals) or agentserver ($AGENTSERVER_STATE_ROOT)"}),
        ("--roots", "roots", {"help": "comma-separated trees to mirror (overrides --layout)"}),
        ("--commit", "commit", {"help": "per-file, snapshot (crash-consistent across files) or auto (snapshot for agentserver)"}),
        ("--prefix", "prefix", {"help": "namespace inside the store; may refer to variables: 'agents/{POD_NAME}'"}),
        ("--session-namespace", "session_namespace",
         {"help": "auto (default): each FOUNDRY_AGENT_SESSION_ID in <prefix>/<agent>/<session>; off: the prefix as written"}),
        ("--ignore", "ignore", {"help": "comma-separated basename globs never mirrored (default *.tmp,.sidecar-*)"}),
        ("--concurrency", "concurrency", {"type": int, "help": "store operations in flight (default 16)"}),
        ("--debounce-ms", "debounce_ms", {"type": int, "help": "watcher polling step while idle, ms (default 25; 2 while busy)"}),
        ("--reconcile-interval", "reconcile_interval", {"type": float, "help": "seconds between local rescans (default 120)"}),
        ("--full-reconcile-interval", "full_reconcile_interval", {"type": float, "help": "seconds between store listings (default 3600)"}),
        ("--drain-timeout", "drain_timeout", {"type": float, "help": "seconds to flush on shutdown (default 20)"}),
        ("--fence-window", "fence_window", {"type": float, "help": "seconds a proof of store ownership is trusted (default 2)"}),
        ("--fence-margin", "fence_margin", {"type": float, "help": "extra wait after a recently active predecessor, seconds (default 8)"}),
        ("--restore-corrupt", "restore_corrupt", {"help": "fail (default) or skip: a corrupt stored object is left out and reported"}),
        ("--max-file-size", "max_file_size", {"type": int, "help": "bytes; larger files are not mirrored"}),
        ("--http-addr", "http_addr", {"help": "host:port for /livez /readyz /metrics ('' disables)"}),
        ("--log-level", "log_level", {"help": "debug, info, warning, error"}),
        ("--log-format", "log_format", {"help": "auto, json, text"}),
    ]


def _add_common(p: argparse.ArgumentParser, restore_flags: bool = True) -> None:
    for flag, dest, kw in _flag_map():
        p.add_argument(flag, dest=dest, default=None, **kw)
    if restore_flags:
        g = p.add_mutually_exclusive_group()
        g.add_argument("--restore", dest="restore", choices=["auto", "skip", "force"], default=None,
                       help="restore rule (default auto: fill empty roots from the store)")
        g.add_argument("--no-restore", dest="restore", action="store_const", const="skip",
                       help="do not restore before mirroring")
        g.add_argument("--force-restore", dest="restore", action="store_const", const="force",
                       help="restore every stored file even into roots that hold files")
        p.add_argument("--restore-optional", dest="restore_optional", action="store_const", const=True,
                       default=None, help="start even when the store cannot be reached (not recommended)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="checkpoint-sidecar",
        description="Mirror agent workflow state to durable storage and bring it back after compute recreation.",
    )
    parser.add_argument("--version", action="version", version=f"checkpoint-sidecar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_common(sub.add_parser("restore", help="one-shot restore (init containers)"))
    _add_common(sub.add_parser("sync", help="restore, then mirror every change until SIGTERM (sidecar)"))
    run = sub.add_parser("run", help="restore, mirror, and run CMD as a child (entrypoint wrapper)",
                         usage="checkpoint-sidecar run [options] -- CMD [ARGS...]")
    _add_common(run)
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command to run, after --")
    st = sub.add_parser("status", help="what is in sync, pending upload, missing locally (exit 0 only in sync)")
    _add_common(st, restore_flags=False)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    pr = sub.add_parser("probe", help="exit 0 when the running sidecar is ready/live (exec probes)")
    _add_common(pr, restore_flags=False)
    pr.add_argument("what", choices=["ready", "live"])
    pr.add_argument("--timeout", type=float, default=2.0)
    return parser


def _root_cause(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}" if not isinstance(e, BaseExceptionGroup) else str(e)


def _fail(msg: str, code: int = EXIT_FAIL) -> int:
    print(f"checkpoint-sidecar: error: {log.redact(msg)}", file=sys.stderr)
    return code


def _limit_malloc_arenas() -> None:
    """glibc gives every thread that allocates an arena of its own, and keeps freed memory in it;
    the store's worker threads would hold tens of MiB that way. Two arenas are plenty here."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def _arun(fn, *args) -> int:
    """Run a command's coroutine on asyncio, with uvloop where it is installed: it halves the
    CPU cost per store request (a 1,000-file restore: 3.2 s of CPU on the default loop, 1.8 s)."""
    try:
        import uvloop  # noqa: F401

        options = {"use_uvloop": True}
    except ImportError:
        options = {}
    return anyio.run(fn, *args, backend_options=options)


def entry() -> None:
    """The ``checkpoint-sidecar`` command: :func:`main`, then exit at once.

    Everything that matters is done when ``main`` returns: files are flushed and synced, the store
    is closed, the child has exited, every log line is written. Python's own shutdown after that
    (module teardown, freeing every object one by one) took 30-40 ms after a large restore, time
    an init container or a host's start waits for; ``os._exit`` skips it.
    """
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    _limit_malloc_arenas()
    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = {dest: getattr(args, dest, None) for _f, dest, _k in _flag_map()}
    for extra in ("restore", "restore_optional"):
        overrides[extra] = getattr(args, extra, None)
    try:
        settings, roots = load(overrides)
    except ConfigError as e:
        for problem in e.problems:
            print(f"checkpoint-sidecar: config error: {log.redact(problem)}", file=sys.stderr)
        return EXIT_CONFIG
    log.setup(settings.log_level, settings.log_format)
    for name in unknown_variables():
        log.warning("unknown_setting", variable=name, detail="not a checkpoint-sidecar setting: ignored (a typo?)")
    logging.getLogger("azure").setLevel(logging.WARNING)  # the SDK logs every request at INFO

    if args.command == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            return _fail("run needs a command: checkpoint-sidecar run [options] -- CMD [ARGS...]", EXIT_CONFIG)
    try:
        if args.command == "restore":
            return _arun(_restore, settings, roots)
        if args.command == "sync":
            return _arun(_sync, settings, roots, Shutdown())
        if args.command == "run":
            return _arun(_run, settings, roots, cmd, Shutdown())
        if args.command == "status":
            return _arun(_status, settings, roots, args.json)
        if args.command == "probe":
            from sidecar.http import probe

            return probe(settings, args.what, args.timeout)
    except KeyboardInterrupt:
        return 130
    except _StoreConfigError as e:
        print(f"checkpoint-sidecar: config error: {log.redact(str(e))}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as e:  # a bug: one line for the operator, the traceback at debug level
        log.debug("traceback", exc=e)
        import traceback

        if settings.log_level == "debug":
            traceback.print_exc()
        return _fail(f"unexpected {type(e).__name__}: {_root_cause(e)}")
    return _fail(f"unknown command {args.command}", EXIT_CONFIG)


# -- commands --------------------------------------------------------------------------------

class _StoreConfigError(Exception):
    """The store URL or its credentials cannot be used (found when the store is built)."""


def _open(settings: Settings):
    from sidecar.store import make_store

    try:
        store = make_store(settings.store, settings.namespace.path)
    except ValueError as e:
        raise _StoreConfigError(str(e)) from None
    return store


async def _prepare(daemon, settings: Settings) -> int | None:
    """Restore by the rule; an exit code when the command must stop, None to go on."""
    from sidecar.fence import IdentityConflict
    from sidecar.restorer import RestoreError
    from sidecar.store.base import StoreError

    try:
        await daemon.prepare()
    except IdentityConflict as e:
        return _fail(f"refusing to start: {e}", EXIT_CONFIG)
    except RestoreError as e:
        return _fail(f"restore failed: {e}")
    except StoreError as e:
        if settings.restore_optional:
            log.error("store_unreachable_starting_anyway", error=str(e))
            return None
        return _fail(f"cannot reach the store: {e} (refusing to start without the saved state; "
                     "SIDECAR_RESTORE_OPTIONAL=true starts anyway)")
    return None


async def _restore(settings: Settings, roots: list[Root]) -> int:
    from sidecar.daemon import Daemon

    store = _open(settings)
    try:
        daemon = Daemon(settings, roots, store)
        code = await _prepare(daemon, settings)  # reads only: the store is claimed by serve(), never here
        if code is None:
            await daemon.report_legacy_state()
        return EXIT_OK if code is None else code
    finally:
        await store.aclose()


async def _serve_http(tg, daemon, settings: Settings) -> int | None:
    """Start the health/metrics listener; an exit code when it cannot listen."""
    if settings.http_host_port() is None:
        return None
    from sidecar.http import HttpBindError, serve

    try:
        await tg.start(serve, settings, daemon)
    except HttpBindError as e:
        tg.cancel_scope.cancel()
        return _fail(str(e))
    return None


async def _sync(settings: Settings, roots: list[Root], shutdown: Shutdown) -> int:
    from sidecar.daemon import Daemon

    store = _open(settings)
    try:
        daemon = Daemon(settings, roots, store)
        async with anyio.create_task_group() as tg:
            tg.start_soon(handle_signals, shutdown, None)
            if (code := await _serve_http(tg, daemon, settings)) is not None:
                return code
            with anyio.CancelScope() as prep_scope:  # a stop during the restore ends it: nothing to flush
                tg.start_soon(_cancel_on, shutdown.requested, prep_scope)
                code = await _prepare(daemon, settings)
            if prep_scope.cancelled_caught:
                tg.cancel_scope.cancel()
                return EXIT_FAIL
            if code is not None:
                tg.cancel_scope.cancel()
                return code
            # Not cancelled by a stop: the first scan queues what the host wrote since the
            # restore, and a stop that came meanwhile drains it below.
            await tg.start(daemon.serve)
            log.info("ready", roots=",".join(r.path for r in roots), store=store.description)
            await shutdown.requested.wait()
            with anyio.CancelScope(shield=True):
                left = await daemon.drain(settings.drain_timeout, abandon=shutdown.forced)
            tg.cancel_scope.cancel()
        return EXIT_OK if left == 0 else EXIT_PENDING
    finally:
        with anyio.CancelScope(shield=True):
            await store.aclose()


async def _cancel_on(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _run(settings: Settings, roots: list[Root], cmd: list[str], shutdown: Shutdown) -> int:
    from sidecar.daemon import Daemon
    from sidecar.runner import Child, SpawnError

    store = _open(settings)
    child: Child | None = None
    try:
        daemon = Daemon(settings, roots, store)
        async with anyio.create_task_group() as tg:
            if (code := await _serve_http(tg, daemon, settings)) is not None:
                return code
            code = await _prepare(daemon, settings)
            if code is not None:  # restore failed: the command never starts
                tg.cancel_scope.cancel()
                return code
            # The child starts as soon as its state is in place; the watcher and the first
            # reconcile come up beside it (that scan, made once the watch is in place, queues
            # anything the child wrote in between), so they add nothing to its start-up time.
            try:
                child = await Child.spawn(cmd)
            except SpawnError as e:
                _fail(str(e))
                tg.cancel_scope.cancel()
                return e.exit_code
            log.info("child_started", pid=child.pid, cmd=cmd[0])
            tg.start_soon(handle_signals, shutdown, child.send)
            await tg.start(daemon.serve)
            rc = await child.wait()
            log.info("child_exited", code=rc)
            await child.end_group()  # before the drain: what its helpers write as they stop is mirrored
            with anyio.CancelScope(shield=True):
                await daemon.drain(settings.drain_timeout, abandon=shutdown.forced)
            tg.cancel_scope.cancel()
        return rc
    finally:
        with anyio.CancelScope(shield=True):
            if child is not None and child.proc.returncode is None:
                child.send(signal.SIGTERM)
                with anyio.move_on_after(5):
                    await child.wait()
                child.send(signal.SIGKILL)
            await store.aclose()


async def _status(settings: Settings, roots: list[Root], as_json: bool) -> int:
    from sidecar import status
    from sidecar.store.base import StoreError

    store = _open(settings)
    try:
        rep = await status.report(settings, roots, store)
    except StoreError as e:
        return _fail(f"cannot reach the store: {e}")
    finally:
        await store.aclose()
    ns = settings.namespace
    print(json.dumps(rep, indent=2) if as_json else status.render(rep, ns.describe() if ns.path or ns.identity else ""))
    return EXIT_OK if rep["in_sync"] else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
