"""Structured logs: one JSON object per line when stderr is not a terminal, readable text when it is.

Every line carries an ``event`` name; fields go in ``extra``-style keyword arguments::

    log.info("uploaded", path=".checkpoints/ctx/1.json", bytes=1234)

Nothing here ever formats a secret: callers pass keys and paths, never credentials, and
:func:`redact` scrubs anything that looks like one from free text (exception messages).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

_LOGGER = logging.getLogger("checkpoint_sidecar")

_SECRET_PATTERNS = [
    re.compile(r"(?i)((?:AccountKey|SharedAccessSignature|sig|password|secret|token|client_secret)=)[^;&\s'\"]+"),
    re.compile(r"(?i)(Bearer\s+)[A-Za-z0-9._~+/=-]+"),
]


def redact(text: str) -> str:
    """``text`` with anything shaped like a credential replaced by ``***``."""
    for pat in _SECRET_PATTERNS:
        text = pat.sub(r"\1***", text)
    return text


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        if record.exc_info and record.exc_info[1] is not None:
            out["error"] = redact(f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}")
        return json.dumps(out, default=str, ensure_ascii=False)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        fields = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        line = f"{ts} {record.levelname.lower():7} {record.getMessage()}" + (f"  {fields}" if fields else "")
        if record.exc_info and record.exc_info[1] is not None:
            line += f"  error={redact(str(record.exc_info[1]))}"
        return line


def setup(level: str = "info", fmt: str = "auto", stream: Any = None) -> None:
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "text" if getattr(stream, "isatty", lambda: False)() else "json"
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    _LOGGER.handlers[:] = [handler]
    _LOGGER.setLevel(level.upper())
    _LOGGER.propagate = False


def _log(level: int, event: str, fields: dict[str, Any], exc: BaseException | None = None) -> None:
    if _LOGGER.isEnabledFor(level):
        for k, v in fields.items():
            if isinstance(v, str):
                fields[k] = redact(v)
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
