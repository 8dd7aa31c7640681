"""A hostile process environment: inotify limits used up, symlinks out of a root, closed stdio,
a child that ignores SIGTERM, control characters in file names.

inotify limits are per user and node-wide, so they are never lowered for the machine: the sidecar
runs in a user namespace of its own (``unshare --user --map-root-user``, the same uid 0 mapped)
whose ``/proc/sys/user/max_inotify_*`` limits are set low. Those limits belong to that namespace
only and go away with it; nothing global is changed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support import Sidecar, json_lines, sidecar_cmd, sidecar_env, store_tree, wait_for
from tests.faults.faultkit import events

pytestmark = pytest.mark.faults


# -- inotify limits -------------------------------------------------------------------------------

CHILD = ("import os\nos.makedirs('.checkpoints/c', exist_ok=True)\n"
         "open('.checkpoints/c/fds.json', 'w').write(' '.join(os.readlink(f'/proc/self/fd/{i}') for i in range(3)))\n"
         "print('out'); import sys; print('err', file=sys.stderr)\n")


@pytest.mark.parametrize("closed", [0, 1, 2, (0, 1, 2)], ids=["stdin", "stdout", "stderr", "all"])
def test_run_with_stdio_closed(work, closed):
    """``run`` started with ``<&-``, ``>&-``, ``2>&-``: it used to abort (exit 134, libuv's
    ``uv__close`` assertion) and lose the flush. The child gets /dev/null where the wrapper had
    nothing, its exit code comes back and its writes are flushed."""
    work, store = work
    closed = closed if isinstance(closed, tuple) else (closed,)
    log = work.parent / "log"
    with open(log, "wb") as logf:
        keep = {1: logf.fileno(), 2: logf.fileno()}

        def close_them() -> None:
            for fd in closed:
                os.close(fd)

        proc = subprocess.run(sidecar_cmd("run", "--store", str(store), "--", sys.executable, "-c", CHILD),
                              cwd=work, env=sidecar_env(), stdin=subprocess.DEVNULL, stdout=keep[1],
                              stderr=keep[2], preexec_fn=close_them, timeout=60)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text
    assert "Traceback" not in text and "Assertion" not in text, text
    fds = store_tree(store)["c/fds.json"].decode().split()
    for fd in closed:
        assert fds[fd] == "/dev/null", fds
    if 2 not in closed:
        assert any(e.get("event") == "shutdown_flushed" for e in json_lines(text)), text


# -- a child that ignores SIGTERM -----------------------------------------------------------------

STUBBORN = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.makedirs('.checkpoints/c', exist_ok=True)
open('.checkpoints/c/state.json', 'w').write('before the stop')
open('ready', 'w').write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def _child_pid(work: Path) -> int:
    return int(wait_for(lambda: (work / "ready").exists() and (work / "ready").read_text().strip(), 15,
                        "child started"))


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_child_ignoring_sigterm_is_killed_after_the_grace(work):
    """SIGTERM forwarded, ignored: after SIDECAR_CHILD_STOP_GRACE the child gets SIGKILL, the
    wrapper flushes and exits 137 (it used to wait for ever)."""
    work, store = work
    sc = Sidecar(work, "run", "--store", str(store), "--", sys.executable, "-c", STUBBORN,
                 env=sidecar_env(SIDECAR_CHILD_STOP_GRACE="1"))
    try:
        child = _child_pid(work)
        sc.wait_event("reconcile_start")
        sc.send(signal.SIGTERM)
        assert sc.proc.wait(30) == 128 + signal.SIGKILL, sc.log()[-3000:]
        assert _gone(child)
        killed = events(sc, "child_killed")
        assert len(killed) == 1 and killed[0]["grace_seconds"] == 1, sc.log()[-3000:]
        assert sc.has_event("shutdown_flushed")
        assert store_tree(store) == {"c/state.json": b"before the stop"}
    finally:
        sc.kill()


def test_a_child_ignoring_sigterm_dies_with_a_killed_wrapper(work):
    """The wrapper SIGKILLed: PR_SET_PDEATHSIG ends the child even though it ignores SIGTERM."""
    work, store = work
    sc = Sidecar(work, "run", "--store", str(store), "--", sys.executable, "-c", STUBBORN)
    try:
        child = _child_pid(work)
        os.kill(sc.proc.pid, signal.SIGKILL)  # only the wrapper
        sc.proc.wait(10)
        wait_for(lambda: _gone(child), 10, "the orphaned child to be killed")
    finally:
        sc.kill()
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.kill(child, signal.SIGKILL)


# -- control characters in names ------------------------------------------------------------------

FORGED = "x\n00:00:00.000 error   forged\x1b[2J\u2028\x85.json"


def test_names_with_control_characters_never_forge_log_lines(work):
    """A symlink named with a newline, an ESC sequence and Unicode line separators is logged
    (``symlink_skipped``): in the text log as one escaped line, in the JSON log as one object."""
    work, store = work
    cps = work / ".checkpoints"
    (cps / "ctx").mkdir(parents=True)
    for fmt in ("text", "json"):
        sc = Sidecar(work, "sync", "--store", str(store), env=sidecar_env(SIDECAR_LOG_FORMAT=fmt))
        try:
            wait_for(lambda sc=sc: "reconcile_start" in sc.log(), 15, "the sidecar to start")
            link = cps / "ctx" / (FORGED + fmt)
            os.symlink("/nowhere", link)
            wait_for(lambda sc=sc: "symlink_skipped" in sc.log(), 15, "symlink_skipped logged", sc.log)
            assert sc.stop() == 0
            os.unlink(link)
        finally:
            sc.kill()
        text = sc.log()
        lines = text.splitlines()  # splits on \n, \x85, \u2028 as well
        assert "\x1b" not in text
        if fmt == "text":
            stamp = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} (debug|info|warning|error)\s")
            assert lines and all(stamp.match(line) for line in lines), lines
            assert not any("forged" in line and "symlink_skipped" not in line for line in lines), lines
            assert any("symlink_skipped" in line and "x\\n00:00:00.000 error   forged\\x1b[2J\\u2028\\x85.json" in line
                       for line in lines), lines
        else:
            parsed = json_lines(text)
            assert len(parsed) == len(lines), lines
            assert any(FORGED in str(e.get("path")) for e in parsed if e.get("event") == "symlink_skipped"), parsed
