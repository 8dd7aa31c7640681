"""The shapes of setting values, checked before their types: text without control characters,
numbers written as people write them, finite durations, comma lists, choices; and the one-line
quoting of a rejected value. Pure; :mod:`sidecar.config` builds its model from these types.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field
from pydantic_settings import NoDecode

from sidecar import log

#: The longest value any setting takes (a store URL with a SAS token is well below it).
MAX_VALUE_CHARS = 4096
#: A duration beyond a year is a mistake (and overflows event-loop timers).
MAX_SECONDS = 365 * 24 * 3600.0


def _num(value: Any) -> str:
    """A number for a message: ``2``, ``0.5``; a huge integer shortened, never an error."""
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        digits = text.lstrip("-")
        return text if len(digits) <= 24 else f"{text[:8]}...({len(digits)} digits)"
    try:
        number = float(text)
    except ValueError:
        return shown(text)
    return str(int(number)) if number.is_integer() and abs(number) < 1e16 else f"{number:g}"


def _shortened(text: str, limit: int) -> str:
    """``text`` escaped (non-ASCII too: :func:`sidecar.log.printable`), shortened past ``limit``."""
    return log.printable(text[:limit], ascii=True) + (f"...({len(text)} characters)" if len(text) > limit else "")


def shown(value: Any, limit: int = 40) -> str:
    """``value`` for a one-line message: quoted, control characters and non-ASCII escaped,
    shortened past ``limit`` characters (never for a value that may be a secret)."""
    text = value if isinstance(value, str) else str(value)
    cut = _shortened(text[:limit], limit).replace("'", "\\'")
    return f"'{cut}'" + (f"...({len(text)} characters)" if len(text) > limit else "")


# -- what every value must be, before its type ---------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _text(v: Any) -> Any:
    """A raw value: UTF-8 text without control characters (NUL, newline...), at most
    MAX_VALUE_CHARS."""
    if isinstance(v, str):
        if _CONTROL.search(v):
            raise ValueError("must not contain control characters (NUL, newline, tab...)")
        if len(v) > MAX_VALUE_CHARS:
            raise ValueError(f"longer than {MAX_VALUE_CHARS} characters ({len(v)})")
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:  # os.environ's surrogate escapes of bytes that are not UTF-8
            raise ValueError("must be UTF-8 text (it holds bytes that are not)") from None
    return v


def _word(v: Any) -> Any:
    """A number, a boolean or a choice: surrounding blanks do not count, nor does case."""
    v = _text(v)
    return v.strip().lower() if isinstance(v, str) else v


def _finite(v: Any) -> Any:
    """A duration: a finite number (``nan`` and ``inf`` are refused before any bound)."""
    v = _word(v)
    if isinstance(v, str):
        try:
            number = float(v)
        except ValueError:
            return v  # the type check says what is wrong
        if number != number or number in (float("inf"), float("-inf")):
            if v.isdigit():  # too many digits for a float
                raise ValueError(f"must be at most {_num(MAX_SECONDS)}; got {_num(v)}")
            raise ValueError(f"must be a finite number, got {shown(v)}")
    return v


def _integer(v: Any) -> Any:
    """A whole number may be written as one: ``8.0``, ``1e9``."""
    v = _word(v)
    if isinstance(v, str) and not v.lstrip("+-").isdigit():
        try:
            number = float(v)
        except ValueError:
            return v  # the type check says what is wrong
        if number.is_integer() and abs(number) < 2**63:
            return int(number)
    return v


def _comma_list(v: Any) -> Any:
    v = _text(v)
    if isinstance(v, str):
        return [p.strip() for p in v.split(",") if p.strip()]
    return v


Text = Annotated[str, BeforeValidator(_text)]
Int = Annotated[int, BeforeValidator(_integer)]
Seconds = Annotated[float, BeforeValidator(_finite), Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
Bool = Annotated[bool, BeforeValidator(_word)]
Words = Annotated[list[str], NoDecode, BeforeValidator(_comma_list)]  # "a,b" in the environment, not JSON


def _choice(*values: str) -> Any:
    return Annotated[Literal[values], BeforeValidator(_word)]


Commit = _choice("auto", "per-file", "snapshot")
SessionNamespace = _choice("auto", "off")
RestoreRule = _choice("auto", "skip", "force")
CorruptRule = _choice("fail", "skip")
LogLevel = _choice("debug", "info", "warning", "error")
LogFormat = _choice("auto", "json", "text")
PositiveSeconds = Annotated[Seconds, Field(gt=0)]


def _duration_with_unit(v: Any) -> Any:
    """A duration that decides what is deleted (``SIDECAR_OLDER_THAN``, ``SIDECAR_LIVE_WITHIN``):
    written with its unit (``7d``, ``1h30m``), never a plain number; :func:`parse_duration`."""
    v = _text(v)
    if isinstance(v, str):
        return parse_duration(v, unit_required=True)
    return v


#: Seconds written with a unit (``90s``, ``2h``, ``7d``): a plain number is refused.
UnitSeconds = Annotated[float, BeforeValidator(_duration_with_unit), Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]


# -- a URL a command pushes to ---------------------------------------------------------------------

_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def check_gateway(url: str) -> str:
    """A Prometheus Pushgateway URL (``http://pushgateway:9091``, or ``host:port``), blanks
    around it dropped; "" (no push) as it is. ValueError, one line that never shows the URL (it
    may carry a user and password)."""
    import ipaddress
    from urllib.parse import urlsplit

    text = url.strip()
    if not text:
        return ""
    wanted = "not an http(s) URL with a host, e.g. http://pushgateway:9091"
    try:
        parts = urlsplit(text if "://" in text else f"http://{text}")
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as e:
        raise ValueError(f"not a URL ({str(e).split(':')[0]})") from None
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not all(_HOST_LABEL.fullmatch(label) for label in host.split(".")):
            raise ValueError(wanted) from None
    if parts.scheme not in ("http", "https") or not host or any(c.isspace() for c in text):
        raise ValueError(wanted)
    return text


# -- durations and times given on a command line ---------------------------------------------------

_UNIT_SECONDS = {"w": 7 * 86400.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|w|d|h|m|s)")


def parse_duration(text: str, unit_required: bool = False) -> float:
    """Seconds in a duration written ``90s``, ``15m``, ``2h``, ``7d``, ``1w``, ``1h30m`` or a plain
    number of seconds; raises ``ValueError`` with a one-line reason (never above a year).
    ``unit_required``: a plain number is refused (a duration that decides what is deleted, where
    ``7`` meant as days would be seven seconds)."""
    t = text.strip().lower()
    if not t:
        raise ValueError("an empty duration; write e.g. 90s, 15m, 2h or 7d")
    try:
        seconds = float(t)
    except ValueError:
        pos, seconds = 0, 0.0
        for m in _DURATION_PART.finditer(t):
            if m.start() != pos:
                break
            seconds += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
            pos = m.end()
        if pos != len(t) or pos == 0:
            raise ValueError(f"not a duration: {shown(text)}; write e.g. 90s, 15m, 2h, 7d or 1h30m") from None
    else:
        if unit_required:
            n = _num(t) if 0 <= seconds <= MAX_SECONDS else "7"
            raise ValueError(f"{shown(text)} has no unit (a plain number would be seconds): write it with one, "
                             f"e.g. {n}d, {n}h, {n}m or {n}s")
    if not seconds == seconds or seconds < 0 or seconds > MAX_SECONDS:  # nan, negative, beyond a year
        raise ValueError(f"a duration must be between 0 and a year, got {shown(text)}")
    return seconds


def parse_time_or_age(text: str) -> tuple[float | None, float | None]:
    """A moment given as an RFC 3339 time with its offset (``2026-12-01T10:00:00Z``) or as a
    duration ago with its unit (``2h``; a plain number is refused): ``(epoch seconds, None)`` or ``(None, seconds ago)``. Raises
    ``ValueError`` with a one-line reason."""
    import datetime

    t = text.strip()
    if t != text:
        raise ValueError(f"spaces or a line break around the time: {shown(text)}")
    if t[:1].isdigit() and ("T" in t.upper() or " " in t) and "-" in t:
        try:
            when = datetime.datetime.fromisoformat(t.replace("z", "Z"))
        except ValueError:
            raise ValueError(f"not an RFC 3339 time: {shown(text)}; write e.g. 2026-12-01T10:00:00Z or 2h") from None
        if when.tzinfo is None:
            raise ValueError(f"an RFC 3339 time needs its offset (Z or +01:00): {shown(text)}")
        return when.timestamp(), None
    try:
        return None, parse_duration(t, unit_required=True)  # "7" meant as days must not restore 7 s ago
    except ValueError as e:
        if "has no unit" in str(e):
            raise
        raise ValueError(f"not a time or a duration ago: {shown(text)}; write e.g. 2026-12-01T10:00:00Z or 2h") from None
