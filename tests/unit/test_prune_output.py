"""What ``prune`` prints, as a terminal shows it (issue #34, item 6): its progress line, drawn in
place on stderr, never runs into the result lines on stdout, which share the screen; counts of
one are singular."""

from __future__ import annotations

import io
import sys

from sidecar.ops.prune import Tally, line
from sidecar.ops.pruner import FAILED, PRUNED, Result


def screen(written: str) -> list[str]:
    """The lines a terminal shows for ``written``: ``\\r`` goes back to the line's start (later
    characters overwrite), ``ESC [ K`` erases from there to the line's end."""
    lines, row, col = [""], 0, 0
    i = 0
    while i < len(written):
        if written.startswith("\x1b[K", i):
            lines[row] = lines[row][:col]
            i += 3
            continue
        c = written[i]
        if c == "\r":
            col = 0
        elif c == "\n":
            row, col = row + 1, 0
            lines.append("")
        else:
            cur = lines[row]
            lines[row] = cur[:col] + c + cur[col + 1:]
            col += 1
        i += 1
    return lines


def test_the_progress_line_never_runs_into_the_result_lines(monkeypatch):
    shared = io.StringIO()  # stdout and stderr on one terminal
    monkeypatch.setattr(sys, "stdout", shared)
    monkeypatch.setattr(sys, "stderr", shared)
    tally = Tally(dry_run=False)
    tally.tty = True
    results = [Result("s1", PRUNED, 1, 1), Result("s2", FAILED, why="refused"), Result("s3", PRUNED, 3, 40)]
    for r in results:
        tally.listed += 1
        tally.eligible += 1
        tally.progress()
        tally.add(r)
        tally.say(line(r, "agents"))
    print(tally.summary())
    shown = [s for s in screen(shared.getvalue()) if s]
    assert shown == ["pruned agents/s1 (1 object, 1 byte)", "failed agents/s2: refused",
                     "pruned agents/s3 (3 objects, 40 bytes)",
                     "prune: pruned 2 namespaces (4 objects, 41 bytes); kept 0 (live, or written too recently); "
                     "skipped 0 (claimed or changed meanwhile: every object kept); failed 1"], shown


def test_no_terminal_no_progress(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    tally = Tally(dry_run=True)
    tally.tty = False
    tally.add(Result("s1", "would prune", 1, 2))
    tally.say(line(Result("s1", "would prune", 1, 2), ""))
    assert err.getvalue() == "" and out.getvalue() == "would prune s1 (1 object, 2 bytes)\n"
    assert tally.summary().startswith("prune: would prune 1 namespace (1 object, 2 bytes);")
