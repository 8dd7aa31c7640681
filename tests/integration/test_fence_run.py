"""A fenced ``run`` stops its host: once a newer sidecar owns the namespace nothing the old
compute writes can be stored, so it must not go on serving. Its child gets SIGTERM, then SIGKILL
after SIDECAR_CHILD_STOP_GRACE, and the wrapper exits 75.

Real processes: an older ``run -- python child.py`` and a newer ``sync`` on the same namespace.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support import Sidecar, wait_for, write_atomic
from tests.integration.fencekit import KINDS, Target, make_target

CHILD = r"""
import os, signal, sys, time
here = sys.argv[1]
ignore = sys.argv[2] == "ignore"

def on_term(sig, frame):
    with open(os.path.join(here, "child-signals"), "a") as f:
        f.write("SIGTERM\n")
    if not ignore:
        sys.exit(0)  # a host that stops gracefully

signal.signal(signal.SIGTERM, on_term)
open(os.path.join(here, "child-started"), "w").close()
while True:
    time.sleep(0.05)
"""


@pytest.fixture(params=KINDS)
def target(request, tmp_path):
    yield from make_target(request, tmp_path)


def fenced_run(target, tmp_path: Path, child_mode: str) -> tuple[Sidecar, Path]:
    """An older ``run`` whose namespace a newer ``sync`` claims; the host keeps writing until the
    older sidecar finds itself fenced. The older wrapper, and its working directory."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = target.env(SIDECAR_PREFIX="agent", SIDECAR_FENCE_WINDOW="0.5", SIDECAR_CHILD_STOP_GRACE="1")
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    older = target.start(old, "run", "--", sys.executable, str(script), str(old), child_mode, env=env)
    older.wait_event("fence_claimed")
    wait_for(lambda: (old / "child-started").exists(), 20, "the host started")
    write_atomic(old / ".checkpoints" / "c" / "one.json", b"from the old compute")
    wait_for(lambda: target.read("agent/.checkpoints/c/one.json") == b"from the old compute", 20, "old mirrored")

    newer = target.start(new, "sync", env=env)
    newer.wait_event("fence_claimed")
    writes = iter(range(10_000))

    def write_and_look() -> bool:
        write_atomic(old / ".checkpoints" / "c" / f"late-{next(writes)}.json", b"stale")
        return older.has_event("fenced")

    wait_for(write_and_look, 30, "the older sidecar fenced", interval=0.2)
    assert newer.stop() == 0
    return older, old


def test_a_fenced_run_stops_its_host_and_exits_75(target, tmp_path):
    older, old = fenced_run(target, tmp_path, "graceful")
    assert older.proc.wait(30) == 75, older.log()[-3000:]
    assert (old / "child-signals").read_text() == "SIGTERM\n"
    [stopped] = [e for e in older.events() if e.get("event") == "child_stopped_fenced"]
    assert "a newer sidecar owns this namespace" in stopped["detail"]
    assert not older.has_event("child_killed")  # it stopped within the grace


def test_a_fenced_run_kills_a_host_that_ignores_sigterm(tmp_path, request):
    # the escalation does not depend on the store: the directory store shows it
    target = Target("directory", tmp_path, request)
    try:
        older, old = fenced_run(target, tmp_path, "ignore")
        assert older.proc.wait(30) == 75, older.log()[-3000:]
        assert (old / "child-signals").read_text() == "SIGTERM\n"
        killed = older.wait_event("child_killed")
        assert killed["grace_seconds"] == 1
        [exited] = [e for e in older.events() if e.get("event") == "child_exited"]
        assert exited["code"] == 137  # SIGKILL, after the grace
    finally:
        target.close()
