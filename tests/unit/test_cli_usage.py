"""The command line's own answers, in process: a value that starts with a dash, each command's
help (its exit codes only, every owner ``sessions`` shows). Issue #34, item 6."""

from __future__ import annotations

import re

import pytest

from sidecar.cli import build_parser, main


def usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    assert e.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "usage error" in line and "Traceback" not in line
    return line


@pytest.mark.parametrize("argv", [("--as-of", "-5m"), ("--as-of=-5m",), ("--as-of", "+2h")])
def test_a_signed_duration_is_refused_for_its_sign_not_taken_for_a_flag(capsys, argv):
    line = usage_error(capsys, "restore", *argv)
    assert "written without a sign" in line and "expected one argument" not in line, line


def test_non_ascii_digits_are_no_duration(capsys):
    line = usage_error(capsys, "restore", "--as-of", "\u0661\u0662h")
    assert "not a time or a duration ago" in line, line


@pytest.mark.parametrize("value", ["7", "1", "0", "1h\n", " 2h"])
def test_as_of_refuses_a_plain_number_and_stray_space(capsys, value):
    """``--as-of 7`` (meant as days?) restored the state of seven seconds ago (outside tester,
    round 2): a duration ago is written with its unit, as every duration that decides what is
    restored or deleted."""
    line = usage_error(capsys, "restore", "--as-of", value)
    assert "has no unit" in line or "spaces or a line break" in line, line


@pytest.mark.parametrize("value", ["seq:", "seq:-1", "seq:1.5", "seq:\u0661\u0662", "seq:" + "9" * 20])
def test_a_seq_is_ascii_digits(capsys, value):
    line = usage_error(capsys, "restore", "--as-of", value)
    assert "seq:N takes the seq of a point" in line, line


def test_a_seq_names_a_point():
    from sidecar.points.plan import AsOf

    assert build_parser("restore").parse_args(["restore", "--as-of", "seq:0000000000000000120"]).as_of == AsOf(seq=120)
    assert build_parser("restore").parse_args(["restore", "--as-of", "2h"]).as_of == AsOf(ago=7200.0)


@pytest.mark.parametrize("command", sorted(build_parser().commands))
def test_each_commands_help_gives_its_own_exit_codes_only(command):
    text = " ".join(build_parser().commands[command].format_help().split())
    assert f"exit codes of {command}: 0" in text
    assert re.search(r"; 2 (bad|refused|when)", text), text  # every command's own 2
    assert "0 ok, 1 runtime failure" not in text  # the generic table is the top-level help's
    if command not in ("sync", "run"):
        assert "75" not in text
    assert ("3 some eligible namespaces failed" in text) == (command == "prune")


def test_sessions_help_names_every_owner():
    from sidecar.ops.sessionplan import LIVE, NONE, PRUNING, RELEASED, STALE, UNKNOWN

    text = " ".join(build_parser().commands["sessions"].format_help().split())
    for owner in (LIVE, RELEASED, STALE, NONE, PRUNING, UNKNOWN):
        assert owner in text, owner
