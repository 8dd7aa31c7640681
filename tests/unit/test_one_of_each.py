"""Each helper exists once in ``sidecar/``: one escaper (:func:`sidecar.log.printable`), one
redactor (:func:`sidecar.log.redact`), one warn-once, one exit-code table."""

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
