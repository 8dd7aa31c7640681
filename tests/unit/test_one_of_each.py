"""Each helper exists once in ``sidecar/``: one escaper (:func:`sidecar.log.printable`), one
redactor (:func:`sidecar.log.redact`), one warn-once, one exit-code table, one time format, one
start-up deadline."""

from __future__ import annotations

import re
from pathlib import Path

from sidecar import log

SIDECAR = Path(__file__).resolve().parents[2] / "sidecar"


def sources() -> dict[str, str]:
    return {str(p.relative_to(SIDECAR)): p.read_text() for p in sorted(SIDECAR.rglob("*.py"))}


def where(pattern: str) -> list[str]:
    return [name for name, text in sources().items() if re.search(pattern, text, re.M)]


def test_one_escaper():
    assert where(r"unicode_escape") == []
    assert where(r"^\s*def \w*(printable|escape)\w*\(") == ["log.py"]


def test_the_escaper_keeps_one_line_and_can_escape_non_ascii():
    assert log.printable("a\nb\x1b\u202e\udcff") == "a\\nb\\x1b\\u202e\\xff"
    assert log.printable("é") == "é"
    assert log.printable("SIDECAR_STÖRE\n", ascii=True) == "SIDECAR_ST\\xd6RE\\n"
    assert log.no_surrogates("a\udcff\n") == "a\\xff\n"


def test_one_redactor():
    assert where(r"^\s*def \w*redact\w*\(") == ["log.py"]


def test_one_warn_once():
    """Warnings given once per key go through :class:`sidecar.log.Once` (no set of its own)."""
    assert where(r"^\s*[\w.]*(WARNED|warned|refused|seen_once)\w*\s*(:\s*set\b.*)?=\s*set\(") == []
    assert where(r"^class Once\b") == ["log.py"]


def test_once_reports_each_key_once_and_remembers_a_bounded_number():
    once = log.Once(limit=2)
    assert [once.first(k) for k in ("a", "a", "b", "c", "a", "b")] == [True, False, True, False, False, False]


def test_one_exit_code_table():
    from sidecar import errors

    assert where(r"exit codes: 0|stopped with changes pending") == ["errors.py"]
    constants = {v for k, v in vars(errors).items() if k.startswith("EXIT_") and isinstance(v, int)}
    assert set(errors.EXIT_MEANINGS) == constants
    docs = (SIDECAR.parent / "docs" / "OPERATIONS.md").read_text()
    assert all(f"| `{code}` |" in docs for code in errors.EXIT_MEANINGS), "docs/OPERATIONS.md: Exit codes"
    # every command's own code is in the table too (prune's 3, verify's 4), defined there only
    assert {3, 4} <= set(errors.EXIT_MEANINGS)
    assert where(r"^EXIT_[\w, ]*=\s*\d") == ["errors.py"]


def test_one_time_format():
    """One clock, one format: store and log times as RFC 3339 UTC with milliseconds (two functions
    gave two precisions)."""
    assert where(r"^\s*def \w*rfc3339\w*\(") == ["log.py"]
    assert where(r"%Y-%m-%dT%H") == []
    assert log.rfc3339(1796119200.5) == "2026-12-01T10:00:00.500Z" and log.rfc3339(None) == "-"


def test_one_startup_deadline():
    """The start-up's retry deadline is one constant (it was written four times)."""
    assert where(r"^STARTUP_RETRY_SECONDS\s*=") == ["retry.py"]
    assert where(r"monotonic\(\)\s*\+\s*\d") == []
