"""Command line: ``checkpoint-sidecar {restore,sync,run,status,probe,release,sessions,prune,history,verify}``.

Parses the flags, reads one validated :class:`~sidecar.config.Settings` (environment + flags) and
hands it to the command: :mod:`sidecar.lifecycle` runs ``restore``, ``sync`` and ``run`` (what
starts and ends them), :mod:`sidecar.ops.status` and :mod:`sidecar.http` answer ``status`` and
``probe``. Errors are one line on stderr and a non-zero exit code, never a traceback:

    0  success (status: in sync)        2  bad configuration or usage
    1  runtime failure (store, restore)   75  stopped with changes still pending (sync), fenced (run)
    status: 1 when not in sync; run: the child's own code (128+N for signal N)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import textwrap
from typing import TYPE_CHECKING, Any, Awaitable, Callable, NoReturn

import anyio

from sidecar import __version__, lifecycle, log
from sidecar.config import ConfigError, SettingDoc, command_settings, load, setting_docs
from sidecar.errors import EXIT_CODES_HELP, EXIT_CONFIG, StoreConfigError, fail, leaves

if TYPE_CHECKING:
    from sidecar.points.plan import AsOf

#: The settings each command takes and applies: derived from the settings model.
COMMAND_SETTINGS = command_settings()

_EPILOG = {
    "restore": "0 once the state is back on disk (or nothing was stored, or the store is not there yet: one warning "
               "names it); 1 when the store cannot be read; "
               "--as-of: 1 when no restore point is at or before TIME, a root holds files (without --force-restore), or the "
               "store is not there; 2 bad configuration or usage (a malformed TIME), or another identity's namespace",
    "sync": "0 once stopped with every change flushed; 1 a failure (the restore, the store); 2 bad configuration; "
            "75 when stopped with changes still pending (not flushed within SIDECAR_DRAIN_TIMEOUT, or fenced by a "
            "newer sidecar)",
    "run": "0 or any other: the child's own exit code (128+N for signal N); 1 if the restore failed (CMD never "
           "starts); 2 bad configuration or usage (CMD never starts); 127/126 if CMD cannot start; 75 when a newer "
           "sidecar fenced it (CMD is stopped: SIGTERM, then SIGKILL after SIDECAR_CHILD_STOP_GRACE)",
    "status": "0 in sync; 1 not in sync, or the store cannot be reached or is not there; 2 bad configuration",
    "probe": "0 ready/live; 1 not, or no answer within --timeout; 2 when SIDECAR_HTTP_ADDR is empty",
    "release": "0 once released (or when the namespace has no owner marker); 1 when the store cannot be reached or "
               "is not there; "
               "2 refused: the owner is live (without --force), or bad configuration",
    "sessions": "0 once every namespace is listed; 1 when the store cannot be listed or is not there; 2 bad "
                "configuration",
    "prune": "0 done (also when nothing was eligible); 1 the store cannot be listed (or does not exist), or the "
             "push to --pushgateway failed; 2 bad usage or configuration (a duration without its unit, --older-than "
             "below 1h without --force); 3 some eligible namespaces failed or were refused, each on a line of its "
             "own (the others were pruned: run it again)",
    "history": "0 once listed (none is fine); 1 when the store cannot be read or is not there; 2 bad configuration",
    "verify": "0 every namespace ok; 4 some namespace is damaged (its lines name the keys); 1 the store is not "
              "there or cannot be read, or holds no namespace below the prefix (nothing verified); 2 bad usage or "
              "configuration",
}
_ENV_NOTE = ("Every flag whose help names a SIDECAR_* variable is also that variable (flags win); the others "
             "(--json, --dry-run, --force, --as-of...) are flags only. Variables of settings a command does not use "
             "are accepted and ignored, but checked: one environment serves every command of a deployment, so a "
             "malformed value is refused by each.")


class _Parser(argparse.ArgumentParser):
    commands: dict[str, argparse.ArgumentParser]  # the top-level parser's subcommand parsers
    """argparse without abbreviations (``--stor`` is not ``--store``), whose usage errors are one
    line on stderr and exit 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        line = message.splitlines()[0] if message else "bad usage"
        print(f"{self.prog}: usage error: {log.printable(log.redact(line))} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)


def _help(doc: SettingDoc) -> str:
    return f"{doc.help} ({doc.variable}; default: {doc.default})".replace("%", "%%")


def _flag_map(command: str = "sync") -> list[tuple[str, str, dict[str, Any]]]:
    """(flag, setting, add_argument options) for each setting ``command`` uses, from the model:
    every value reaches :func:`sidecar.config.load` as given, which converts and checks it."""
    docs = {d.name: d for d in setting_docs()}
    out = []
    for name in COMMAND_SETTINGS[command]:
        doc = docs[name]
        kw: dict[str, Any] = {"help": _help(doc), "metavar": doc.metavar or doc.name.upper()}
        if doc.kind == "bool":
            kw = {"help": _help(doc), "action": "store_const", "const": True}
        elif doc.choices:
            kw["metavar"] = "{" + ",".join(doc.choices) + "}"
        out.append((doc.flag, name, kw))
    return out


def _add_common(p: argparse.ArgumentParser, command: str) -> None:
    """The flags of the settings ``command`` uses; ``--restore`` with its two shorthands."""
    for flag, dest, kw in _flag_map(command):
        if dest == "restore":
            g = p.add_mutually_exclusive_group()
            g.add_argument(flag, dest=dest, default=None, **kw)
            g.add_argument("--no-restore", dest="restore", action="store_const", const="skip",
                           help="do not restore before mirroring (SIDECAR_RESTORE=skip)")
            g.add_argument("--force-restore", dest="restore", action="store_const", const="force",
                           help="restore every stored file even into roots that hold files; with restore --as-of, make "
                                "each root equal the point: what differs is moved into .<root>.replaced-<time>/ "
                                "beside the root, listed (SIDECAR_RESTORE=force)")
        else:
            p.add_argument(flag, dest=dest, default=None, **kw)


def _epilog(*paragraphs: str) -> str:
    return "\n\n".join(textwrap.fill(p, 88) for p in paragraphs)


def _unrecognized(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> str:
    """The usage error for arguments ``command`` does not take, with a hint for a flag that is
    misspelt or belongs to another command."""
    message = f"unrecognized arguments: {' '.join(extra)}"
    flag = next((a.split("=", 1)[0] for a in extra if a.startswith("--")), None)
    if flag is None:
        return message
    own = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    others = sorted(c for c, names in COMMAND_SETTINGS.items()
                    if any(flag == "--" + n.replace("_", "-") for n in names))
    if others:
        return f"{message} ({flag} is not an option of {command}, only of {', '.join(others)})"
    import difflib  # only on this error path

    near = difflib.get_close_matches(flag, own, n=1, cutoff=0.75)
    return f"{message} (did you mean {near[0]}?)" if near else message


def _timeout(text: str) -> float:
    """``probe --timeout``: seconds, finite and positive."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text[:40]!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 3600 seconds, got {text[:40]!r}")
    return value


def _as_of(text: str) -> AsOf:
    """``restore --as-of``: an RFC 3339 time with its offset, a duration ago, or ``seq:N`` (a
    point by the seq ``history`` lists)."""
    from sidecar.configtypes import parse_time_or_age
    from sidecar.points.plan import AsOf

    if text[:1] in "-+" and text[1:2].isdigit():
        raise argparse.ArgumentTypeError(f"a duration ago is written without a sign, e.g. {text[1:40]} for that long "
                                         f"ago, got {text[:40]!r}")
    if text[:4].lower() == "seq:":
        if not re.fullmatch(r"[0-9]{1,19}", text[4:]):
            raise argparse.ArgumentTypeError(f"seq:N takes the seq of a point as history lists it (digits), "
                                             f"got {text[:40]!r}")
        return AsOf(seq=int(text[4:]))
    try:
        return AsOf(*parse_time_or_age(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _joined_values(argv: list[str]) -> list[str]:
    """``argv`` with ``--as-of -5m`` written ``--as-of=-5m``: argparse takes a value that starts
    with a dash for an option and says "expected one argument"; joined, the value's own check
    answers (a duration ago has no sign)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if i and argv[i - 1] == "--as-of" and arg[:1] == "-" and arg[1:2].isdigit() and out[-1] == "--as-of":
            out[-1] = f"--as-of={arg}"
        else:
            out.append(arg)
    return out


def build_parser(only: str | None = None) -> _Parser:
    """The command line: one subparser per command, each with only the flags it uses. ``only``:
    the one command whose setting flags are added (the command being run: the other
    subcommands' flags cost start-up time and are never parsed); None: every command's."""
    parser = _Parser(
        prog="checkpoint-sidecar",
        description="Mirror agent workflow state to durable storage and bring it back after compute recreation.",
        epilog=_epilog(_ENV_NOTE, EXIT_CODES_HELP + " (each command's --help: its own)"),
    )
    parser.commands = {}
    parser.add_argument("--version", action="version", version=f"checkpoint-sidecar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def add(command: str, help: str, **kw: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(command, help=help, description=help,
                           epilog=_epilog(_ENV_NOTE, f"exit codes of {command}: {_EPILOG[command]}"), **kw)
        if only is None or command == only:
            _add_common(p, command)
        parser.commands[command] = p
        return p

    add("restore", "one-shot restore (init containers)").add_argument(
        "--as-of", type=_as_of, metavar="TIME", help="fill the roots with the namespace as it was at TIME (RFC 3339 "
        "with offset, or a duration ago such as 2h, on the store's clock): the newest restore point at or before it; "
        "seq:N for the point of seq N that history lists (two points in one second of the store's clock)")
    add("sync", "restore, then mirror every change until SIGTERM (sidecar)")
    run = add("run", "restore, mirror, and run CMD as a child (entrypoint wrapper)",
              usage="checkpoint-sidecar run [options] -- CMD [ARGS...]")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command to run, after --")
    st = add("status", "what is in sync, pending upload, missing locally (exit 0 only in sync)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    pr = add("probe", "exit 0 when the running sidecar is ready/live (exec probes)")
    pr.add_argument("what", choices=["ready", "live"])
    pr.add_argument("--timeout", type=_timeout, default=2.0, help="seconds to wait for the answer (default: 2)")
    add("release", "hand the namespace over: its owner marker then names no identity, so a sidecar of any "
                   "identity may claim it; instead of deleting the marker. A live owner (its marker rewritten "
                   "within --live-within, by the store's clock) is refused unless --force: a release fences it").add_argument(
        "--force", action="store_true", help="release even a live owner: that running sidecar is fenced at its next "
        "write and stops mirroring (no variable)")
    _add_namespace_commands(add)
    add("history", "the namespace's restore points, newest first: time (store clock), kind, files, bytes, seq").add_argument(
        "--json", action="store_true", help="one JSON object per line")
    ve = add("verify", "check every namespace below the prefix before trusting the store: each object's metadata, "
                       "each restore point's header and chain; with --read-data every byte against its sha256. "
                       "A damaged object is named with the restore point that recovers it. Reads only")
    ve.add_argument("--read-data", action="store_true",
                    help="also read every object and restore point whole (streamed) and check its sha256s")
    ve.add_argument("--json", action="store_true", help="one JSON object per namespace per line")
    return parser


def _add_namespace_commands(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``sessions`` and ``prune`` (docs/OPERATIONS.md, "Sessions and pruning"); their
    ``--live-within``, ``--older-than`` and ``--pushgateway`` are settings (``SIDECAR_*``)."""
    se = add("sessions", "every namespace in the store, a line each: owner (live, released, stale, none, pruning, "
                         "unknown), files, bytes, last write, restore points, identity")
    se.add_argument("--json", action="store_true", help="one JSON object per line")
    pr = add("prune", "delete whole namespaces whose session ended (owner released, stale or none: not live) and "
                      "whose last write is older than --older-than; a namespace claimed meanwhile keeps every "
                      "object. 'released' is a sidecar's clean exit: on Foundry every idle session's compute is "
                      "stopped, and its namespace released, minutes after its last turn, so --older-than is what "
                      "keeps a paused workflow")
    pr.add_argument("--dry-run", action="store_true", help="delete nothing; print what would be pruned (no variable)")
    pr.add_argument("--force", action="store_true",
                    help="allow --older-than below 1h, which deletes sessions idle for less than an hour "
                         "(no variable: a floor lowered on purpose, run by run)")


def _command_in(argv: list[str]) -> str:
    """The command ``argv`` runs: its first word, which only the top-level options (``-h``,
    ``--version``: they exit) precede; "" when there is none or it is no command (top-level help
    or a usage error, which need no command's flags)."""
    word = next((a for a in argv if not a.startswith("-")), "")
    return word if word in _EPILOG else ""


def _limit_malloc_arenas() -> None:
    """glibc gives every thread that allocates an arena of its own, and keeps freed memory in it;
    the store's worker threads would hold tens of MiB that way. Two arenas are plenty here."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def _arun(fn: Callable[..., Awaitable[int]], *args: object) -> int:
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
    (module teardown, freeing every object one by one) is time an init container or a host's
    start would wait for; ``os._exit`` skips it (bench/RESULTS.md has the figures).

    Any of fd 0, 1, 2 found closed gets ``/dev/null`` first (:func:`sidecar.log.ensure_stdio`).
    """
    log.ensure_stdio()
    try:
        code = main()
    except KeyboardInterrupt:  # SIGINT before the command's own handling (during start-up)
        code = 130
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    _limit_malloc_arenas()
    argv = _joined_values(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_in(argv))
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = parser.commands[args.command]
        sub.error(_unrecognized(sub, args.command, extra))
    overrides = {name: getattr(args, name, None) for name in COMMAND_SETTINGS[args.command]}
    try:
        settings, roots = load(overrides)
    except ConfigError as e:
        for problem in e.problems:
            print(f"checkpoint-sidecar: config error: {log.redact(problem)}", file=sys.stderr)
        return EXIT_CONFIG
    log.setup(settings.log_level, settings.log_format)
    logging.getLogger("azure").setLevel(logging.WARNING)  # the SDK logs every request at INFO

    if args.command == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            return fail("run needs a command: checkpoint-sidecar run [options] -- CMD [ARGS...]", EXIT_CONFIG)
    try:
        if args.command == "restore":
            return _arun(lifecycle.restore, settings, roots, args.as_of)
        if args.command == "sync":
            return _arun(lifecycle.sync, settings, roots)
        if args.command == "run":
            return _arun(lifecycle.run, settings, roots, cmd)
        if args.command == "status":
            from sidecar.ops import status  # not on the start path of the other commands

            return _arun(status.command, settings, roots, args.json)
        if args.command == "release":
            return _arun(lifecycle.release, settings, roots, args.force)
        if args.command == "sessions":
            from sidecar.ops import sessions

            return _arun(sessions.command, settings, args.json, settings.live_within)
        if args.command == "prune":
            from sidecar.ops import prune

            return _arun(prune.command, settings, args.dry_run, args.force)
        if args.command == "history":
            from sidecar.ops import history

            return _arun(history.command, settings, args.json)
        if args.command == "verify":
            from sidecar.ops import verify

            return _arun(verify.command, settings, args.read_data, args.json)
        if args.command == "probe":
            from sidecar.http import probe

            return probe(settings, args.what, args.timeout)
    except KeyboardInterrupt:
        return 130
    except StoreConfigError as e:
        print(f"checkpoint-sidecar: config error: {log.redact(str(e))}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as e:  # a bug: one line for the operator, the traceback at debug level
        log.debug("traceback", exc=e)
        import traceback

        if settings.log_level == "debug":
            traceback.print_exc()
        cause = next(leaves(e))  # the first exception inside any (nested) exception group
        return fail(f"unexpected {type(e).__name__}: {type(cause).__name__}: {cause}")
    return fail(f"unknown command {args.command}", EXIT_CONFIG)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
