"""Structured logs: one JSON object per line when stderr is not a terminal, readable text when it is.

Every line carries an ``event`` name; fields go in ``extra``-style keyword arguments::

    log.info("uploaded", path=".checkpoints/ctx/1.json", bytes=1234)

Every string that reaches a text line goes through :func:`printable` (a file name with a newline or
an escape sequence cannot forge a line or drive a terminal); JSON lines are escaped by JSON itself,
plus the line separators ``str.splitlines`` honours that JSON leaves raw (U+0085, U+2028, U+2029).

Nothing here ever formats a secret: callers pass keys and paths, never credentials, and
:func:`redact` scrubs anything that looks like one from free text (exception messages).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import sys
import time
from typing import Any, Hashable, Iterable
from urllib.parse import unquote

_LOGGER = logging.getLogger("checkpoint_sidecar")

#: What a credential looks like in free text, and what it becomes.
_SECRET_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # Connection-string fields and query parameters holding secrets: AccountKey=..., sig=...
    (
        re.compile(
            r"(?i)(AccountKey|SharedAccessSignature|SharedAccessKey|sig|signature|client_secret|secret|"
            r"password|pwd|access_token|refresh_token|token)=([^;&\s'\",]+)"
        ),
        r"\1=***",
    ),
    # Authorization header values.
    (re.compile(r"(?i)\b(Bearer)\s+[A-Za-z0-9._~+/=-]+"), r"\1 ***"),
    (re.compile(r"(?i)\b(SharedKey(?:Lite)?)\s+([^:\s]+):\S+"), r"\1 \2:***"),
    # JWTs (Azure AD tokens) wherever they appear.
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"), "***"),
    # A bare storage account key: 64 random bytes are 88 base64 characters ending in '=='.
    (re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{86}=="), "***"),
]


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every known secret and anything shaped like a credential replaced by ``***``.

    ``secrets`` are exact values to remove (keys, SAS tokens, connection strings, proxy
    passwords), also in their URL-decoded form; the patterns catch ``AccountKey=``, ``sig=``,
    ``password=``..., ``Bearer``/``SharedKey`` authorization values, JWTs and bare account keys
    even when the value is not known. The one redactor: log lines, error lines and the stores'
    messages all go through it.
    """
    out = str(text)
    known: set[str] = set()
    for s in secrets:
        if s and len(s) >= 6:
            known.add(s)
            known.add(unquote(s))
    for s in sorted(known, key=len, reverse=True):
        out = out.replace(s, "***")
    for pattern, repl in _SECRET_PATTERNS:
        out = pattern.sub(repl, out)
    return out


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def count(n: int, noun: str, plural: str = "") -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1: ``1 namespace``, ``2 namespaces``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def printable(text: str, *, ascii: bool = False) -> str:
    """``text`` safe for one line of a log or a terminal: control and other non-printable
    characters (newlines, ESC, bidi overrides, line separators) as ``\\n``, ``\\x1b``,
    ``\\u202e``..., undecodable bytes (lone surrogates from ``os.fsdecode``) as ``\\xNN``.
    Printable text, non-ASCII letters included, is returned unchanged; with ``ascii`` every
    non-ASCII character is escaped too (a look-alike letter in a setting's name shows)."""
    if text.isprintable() and (not ascii or text.isascii()):
        return text
    out = []
    for ch in text:
        o = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif 0xDC80 <= o <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
            out.append(f"\\x{o - 0xDC00:02x}")
        elif ch.isprintable() and (not ascii or o < 0x80):
            out.append(ch)
        elif o < 0x100:
            out.append(f"\\x{o:02x}")
        elif o < 0x10000:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    return "".join(out)


def no_surrogates(text: str) -> str:
    """Undecodable bytes (lone surrogates from ``os.fsdecode``) as ``\\xNN``, the rest unchanged:
    a lone surrogate cannot be written as UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def rfc3339(t: float | None) -> str:
    """A time (unix seconds: the store's clock, a log record's) as RFC 3339 UTC with milliseconds,
    ``2026-01-02T03:04:05.678Z``, as ``restore --as-of`` takes it back; ``-`` when unknown."""
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


#: characters ``str.splitlines`` breaks on that ``json.dumps(ensure_ascii=False)`` leaves raw
_JSON_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": rfc3339(record.created),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        if record.exc_info and record.exc_info[1] is not None:
            out["error"] = redact(f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}")
        return no_surrogates(json.dumps(out, default=str, ensure_ascii=False)).translate(_JSON_BREAKS)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        fields = " ".join(f"{printable(str(k))}={printable(str(v))}" for k, v in getattr(record, "fields", {}).items())
        line = f"{ts} {record.levelname.lower():7} {printable(record.getMessage())}" + (f"  {fields}" if fields else "")
        if record.exc_info and record.exc_info[1] is not None:
            line += f"  error={printable(redact(str(record.exc_info[1])))}"
        return line


def ensure_stdio() -> None:
    """Put ``/dev/null`` on any of fd 0, 1 and 2 that is closed (``2>&-``), first thing.

    Otherwise the next descriptor opened (a pipe, a socket, the store's file) takes the number and
    a ``print`` or a log line lands in it, libuv aborts when it closes it (``uv__close: Assertion
    fd > STDERR_FILENO``), and ``run``'s child inherits it as its stdio. Logs to a closed stderr
    are thereby dropped; the child gets ``/dev/null`` where the wrapper had nothing."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: ``fd`` itself
            except OSError:
                continue
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stdin is None:
        sys.stdin = open(0, closefd=False)  # noqa: SIM115  (the process's own stream, never closed)
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115


def setup(level: str = "info", fmt: str = "auto", stream: Any = None) -> None:
    logging.raiseExceptions = False  # a log line that cannot be written (EPIPE) is dropped, never raised
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "text" if getattr(stream, "isatty", lambda: False)() else "json"
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    _LOGGER.handlers[:] = [handler]
    _LOGGER.setLevel(level.upper())
    _LOGGER.propagate = False


class Once:
    """What was reported already, so that a warning is logged once per key: the first ``limit``
    keys are remembered (memory stays bounded), later ones are not reported at all."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._seen: set[Hashable] = set()

    def first(self, key: Hashable) -> bool:
        """True the first time ``key`` comes (while fewer than ``limit`` are remembered)."""
        if key in self._seen or len(self._seen) >= self.limit:
            return False
        self._seen.add(key)
        return True


def _log(level: int, event: str, fields: dict[str, Any], exc: BaseException | None = None) -> None:
    if _LOGGER.isEnabledFor(level):
        for k, v in fields.items():
            if isinstance(v, str):
                fields[k] = redact(v if v.isascii() else no_surrogates(v))
        _LOGGER.log(level, event, extra={"fields": fields},
                    exc_info=(type(exc), exc, None) if exc is not None else None)


def debug(event: str, **fields: Any) -> None:
    _log(logging.DEBUG, event, fields)


def info(event: str, **fields: Any) -> None:
    _log(logging.INFO, event, fields)


def warning(event: str, exc: BaseException | None = None, **fields: Any) -> None:
    _log(logging.WARNING, event, fields, exc)


def error(event: str, exc: BaseException | None = None, **fields: Any) -> None:
    _log(logging.ERROR, event, fields, exc)
