"""Durations and times as a command line gives them (``prune --older-than``, ``restore --as-of``)."""

import pytest

from sidecar.configtypes import parse_duration, parse_time_or_age


@pytest.mark.parametrize("text, seconds", [("0s", 0), ("0", 0), ("90", 90), ("90s", 90), ("15m", 900), ("2h", 7200),
                                           ("7d", 7 * 86400), ("1w", 7 * 86400), ("1h30m", 5400), ("1.5h", 5400),
                                           ("250ms", 0.25), (" 2H ", 7200)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "h", "2x", "-1h", "1h 30m", "2h30", "nan", "inf", "400d", "1e400", "h2"])
def test_bad_durations_say_so_in_one_line(text: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_duration(text)
    assert "\n" not in str(e.value)


def test_times_and_ages() -> None:
    assert parse_time_or_age("2h") == (None, 7200)
    assert parse_time_or_age("2026-12-01T10:00:00Z") == (1796119200.0, None)
    assert parse_time_or_age("2026-12-01T11:00:00+01:00") == (1796119200.0, None)
    for bad in ("2026-12-01T10:00:00", "2026-13-01T10:00:00Z", "yesterday"):
        with pytest.raises(ValueError):
            parse_time_or_age(bad)


@pytest.mark.parametrize("text", ["7", "0", " 90 ", "1.5", "1e3", "nan", "-1"])
def test_a_duration_that_deletes_needs_its_unit(text: str) -> None:
    """The same parser; ``unit_required`` refuses a plain number (``prune --older-than 7``)."""
    with pytest.raises(ValueError, match="has no unit") as e:
        parse_duration(text, unit_required=True)
    assert "\n" not in str(e.value)
    assert parse_duration("7d", unit_required=True) == 7 * 86400
    assert parse_duration("0s", unit_required=True) == 0


def test_durations_take_ascii_digits_only() -> None:
    with pytest.raises(ValueError):
        parse_duration("\u0661\u0662h")
