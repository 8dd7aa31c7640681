"""``run -- CMD``: exit codes, signal forwarding, restore gating, parent death."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from support import Sidecar, json_lines, run_cli, sidecar_cmd, sidecar_env, store_tree, wait_for


def proc_state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, T, Z...); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_child_exit_code_is_passed_through(work):
    work, store = work
    r = run_cli("run", "--store", str(store), "--", sys.executable, "-c", "raise SystemExit(3)", cwd=work)
    assert r.returncode == 3
    r = run_cli("run", "--store", str(store), "--", sys.executable, "-c",
                "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", cwd=work)
    assert r.returncode == 128 + 9


def test_child_writes_are_durable_when_the_wrapper_exits(work):
    work, store = work
    code = ("import os\nos.makedirs('.checkpoints/c', exist_ok=True)\n"
            "for i in range(50):\n open(f'.checkpoints/c/{i}.json.tmp','w').write(str(i)); "
            "os.replace(f'.checkpoints/c/{i}.json.tmp', f'.checkpoints/c/{i}.json')\n")
    r = run_cli("run", "--store", str(store), "--", sys.executable, "-c", code, cwd=work)
    assert r.returncode == 0, r.stderr
    assert store_tree(store) == {f"c/{i}.json": str(i).encode() for i in range(50)}


def test_failed_restore_never_starts_the_command(work):
    work, store = work
    blocker = work.parent / "file"
    blocker.write_text("x")
    marker = work / "started"
    r = run_cli("run", "--store", str(blocker / "s"), "--", "touch", str(marker), cwd=work)
    assert r.returncode == 1 and "cannot reach the store" in r.stderr
    assert not marker.exists()


def test_the_store_is_claimed_after_the_restore_and_before_our_first_write(work):
    """The fence claim (two store requests) is kept off the host's start: it comes after the
    restore and the spawn, and no upload happens before it."""
    work, store = work
    write = ("import os\nos.makedirs('.checkpoints/c', exist_ok=True)\n"
             "open('.checkpoints/c/a.json', 'w').write('a')\n")
    for _round in range(2):  # the second start restores a.json first
        r = run_cli("run", "--store", str(store), "--log-level", "debug", "--", sys.executable, "-c", write, cwd=work)
        assert r.returncode == 0, r.stderr
        order = [e["event"] for e in json_lines(r.stderr)
                 if e.get("event") in ("restore_done", "child_started", "fence_claimed", "uploaded")]
        assert order == ["restore_done", "child_started", "fence_claimed", "uploaded"], order
        os.unlink(work / ".checkpoints" / "c" / "a.json")  # fresh compute for the next round
        os.rmdir(work / ".checkpoints" / "c")
    assert store_tree(store) == {"c/a.json": b"a"}


def test_missing_command_and_bad_config(work):
    work, store = work
    r = run_cli("run", "--store", str(store), "--", "/no/such/binary", cwd=work)
    assert r.returncode == 127 and "command not found" in r.stderr
    r = run_cli("run", "--store", str(store), cwd=work)
    assert r.returncode == 2
    r = run_cli("sync", "--store", "ftp://x", "--concurrency", "0", cwd=work)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 2


def test_unusable_azure_credentials_are_a_config_error(work, monkeypatch):
    """Found only when the store is built (after the settings parse): still a one-line config
    error with exit 2, never "unexpected", and the command is not started."""
    work, _store = work
    marker = work / "started"
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    cases = [
        ({}, "only sent over https"),  # Azure AD over plain http
        ({"AZURE_STORAGE_KEY": "not base64!"}, "AZURE_STORAGE_KEY is not an account key"),
    ]
    for env, expected in cases:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        r = run_cli("run", "--store", "http://127.0.0.1:9/devstoreaccount1/state", "--", "touch", str(marker), cwd=work)
        for name in env:
            monkeypatch.delenv(name)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "config error" in lines[0], r.stderr
        assert expected in lines[0] and "unexpected" not in r.stderr
        assert "not base64!" not in r.stderr
    assert not marker.exists()


TRAP = """
import os, signal, sys, time
def bye(sig, frame):
    os.makedirs('.checkpoints/c', exist_ok=True)
    open('.checkpoints/c/last.json', 'w').write('written on ' + signal.Signals(sig).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
signal.signal(signal.SIGHUP, lambda *a: open('hup', 'w').write('hup'))
open('ready', 'w').write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def test_signals_are_forwarded_and_the_last_write_flushed(work):
    work, store = work
    sc = Sidecar(work, "run", "--store", str(store), "--", sys.executable, "-c", TRAP)
    wait_for(lambda: (work / "ready").exists(), 15, "child started")
    sc.send(signal.SIGHUP)
    wait_for(lambda: (work / "hup").exists(), 5, "SIGHUP forwarded")
    assert sc.stop(signal.SIGTERM) == 0, sc.log()
    assert store_tree(store) == {"c/last.json": b"written on SIGTERM"}


def test_child_is_terminated_when_the_wrapper_dies(work):
    work, store = work
    sc = Sidecar(work, "run", "--store", str(store), "--", sys.executable, "-c", TRAP)
    child = int(wait_for(lambda: (work / "ready").exists() and (work / "ready").read_text().strip(), 15,
                         "child started"))
    os.kill(sc.proc.pid, signal.SIGKILL)  # only the wrapper
    sc.proc.wait(5)

    wait_for(lambda: proc_state(child) in (None, "Z"), 10, "orphaned child to exit")


def test_second_signal_abandons_the_flush(work):
    work, store = work
    sc = Sidecar(work, "run", "--store", str(store), "--drain-timeout", "120", "--", sys.executable, "-c", TRAP)
    wait_for(lambda: (work / "ready").exists(), 15, "child started")
    # break the store: its root directory becomes a file, so every upload fails and is retried
    store.mkdir(exist_ok=True)
    (store / ".checkpoints").write_text("not a directory")
    sc.send(signal.SIGTERM)
    sc.wait_event("child_exited")
    wait_for(lambda: sc.has_event("store_retry"), 10, "upload failing")
    assert sc.proc.poll() is None  # still trying to flush
    assert sc.stop(signal.SIGTERM, timeout=10) == 0  # the child's code, promptly
    assert sc.has_event("flush_abandoned") and sc.has_event("shutdown_pending")


class Terminal:
    """``checkpoint-sidecar run -- python -c CHILD`` on a real pseudo-terminal, as a shell runs a
    command: the wrapper is its session's foreground process group. Killed on exit if still up."""

    def __init__(self, work, store, child: str) -> None:
        import pty

        argv = sidecar_cmd("run", "--store", str(store), "--", sys.executable, "-c", child)
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # pragma: no cover - the forked child
            os.chdir(work)
            os.execvpe(argv[0], argv, sidecar_env())
        self.out = bytearray()
        self.status: int | None = None

    def read(self) -> bytes:
        """Everything the terminal has shown so far (read as it comes, so no writer blocks)."""
        import select

        while select.select([self.fd], [], [], 0)[0]:
            try:
                self.out.extend(os.read(self.fd, 4096))
            except OSError:  # the terminal closed: everyone exited
                break
        return bytes(self.out)

    def exited(self) -> bool:
        self.read()
        if self.status is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.status = status
        return self.status is not None

    def wait(self, cond, timeout: float, what: str) -> None:
        wait_for(lambda: self.read() is not None and cond(), timeout, what,
                 diagnostics=lambda: "\n" + self.out.decode(errors="replace")[-2000:])

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def __enter__(self) -> "Terminal":
        return self

    def __exit__(self, *exc) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        os.close(self.fd)


def test_a_child_that_reads_the_terminal_gets_it(work):
    """``docker run -it`` or a shell: the wrapper holds a terminal. The child must be able to read
    it: in a background process group of its own it would be stopped (SIGTTIN) for good and no
    signal would end the pair, so it stays in the wrapper's foreground group."""
    work, store = work
    child = "import sys; line = sys.stdin.readline(); print('got ' + line.strip(), flush=True)"
    with Terminal(work, store, child) as t:
        t.type(b"hello\n")
        t.wait(lambda: b"got hello" in t.out, 30, "the child to read the terminal")
        t.wait(t.exited, 30, "the wrapper to exit")
        assert os.waitstatus_to_exitcode(t.status) == 0


def test_a_stopped_child_still_ends_on_sigterm(work):
    """A child stopped (SIGSTOP, or Ctrl-Z once it holds the terminal) would keep a forwarded
    SIGTERM pending for ever: SIGCONT follows it."""
    work, store = work
    sc = Sidecar(work, "run", "--store", str(store), "--", sys.executable, "-c", TRAP)
    child = int(wait_for(lambda: (work / "ready").exists() and (work / "ready").read_text().strip(), 15,
                         "child started"))
    os.kill(child, signal.SIGSTOP)

    try:
        wait_for(lambda: proc_state(child) == "T", 5, "child stopped")
        assert sc.stop(signal.SIGTERM) == 0, sc.log()
    finally:
        with contextlib.suppress(ProcessLookupError):  # never left behind stopped, whatever happened
            os.kill(child, signal.SIGKILL)
    assert store_tree(store) == {"c/last.json": b"written on SIGTERM"}


def test_helpers_the_child_left_running_are_ended_with_it(work):
    """The child starts a helper in its process group and exits without stopping it: the helper
    must not outlive the wrapper (outside a container nothing else would end it), and is ended
    while mirroring still runs."""
    work, store = work
    helper_code = ("import os, signal, sys, time\n"
                   "def bye(*a):\n"
                   " os.makedirs('.checkpoints/c', exist_ok=True)\n"
                   " open('.checkpoints/c/helper.json', 'w').write('written as it stopped'); sys.exit(0)\n"
                   "signal.signal(signal.SIGTERM, bye)\n"
                   "open('helper', 'w').write(str(os.getpid()))\n"
                   "time.sleep(120)\n")
    code = ("import os, subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', {helper_code!r}])\n"
            "while not os.path.exists('helper'): time.sleep(0.01)\n")
    r = run_cli("run", "--store", str(store), "--", sys.executable, "-c", code, cwd=work)
    assert r.returncode == 0, r.stderr
    helper = int((work / "helper").read_text())
    # ended before the drain, so what it wrote as it stopped is mirrored
    assert store_tree(store) == {"c/helper.json": b"written as it stopped"}

    try:
        wait_for(lambda: proc_state(helper) in (None, "Z"), 10, "the helper to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(helper, signal.SIGKILL)


def test_ctrl_c_on_a_terminal_reaches_the_child_once(work):
    """On a terminal the child shares the wrapper's foreground group: Ctrl-C reaches both from the
    terminal, and the wrapper must not send it a second one."""
    work, store = work
    child = ("import os, signal, sys, time\n"
             "def got(*a):\n"
             " open('ints', 'a').write('int\\n')\n"
             "signal.signal(signal.SIGINT, got)\n"
             "open('ready', 'w').write('1')\n"
             "while not os.path.exists('done'): time.sleep(0.01)\n")
    with Terminal(work, store, child) as t:
        t.wait((work / "ready").exists, 30, "child started")
        t.type(b"\x03")  # Ctrl-C
        # the wrapper logs the shutdown request after it would have forwarded the signal
        t.wait(lambda: b"shutdown_requested" in t.out, 10, "the wrapper's SIGINT")
        t.wait((work / "ints").exists, 10, "SIGINT at the child")
        (work / "done").write_text("1")  # the child checks it only after handling pending signals
        t.wait(t.exited, 30, "the wrapper to exit")
        assert (work / "ints").read_text() == "int\n", "the child got Ctrl-C more than once"


def test_ctrl_backslash_on_a_terminal_ends_the_child_not_the_wrapper(work):
    """Ctrl-\\ (SIGQUIT) reaches the whole foreground group; the wrapper ignores it, so it reports
    the child's death by SIGQUIT (131) after flushing, instead of dying with it unflushed."""
    work, store = work
    child = ("import os, time\n"
             "os.makedirs('.checkpoints/c', exist_ok=True)\n"
             "open('.checkpoints/c/a.json', 'w').write('a')\n"
             "open('ready', 'w').write('1')\n"
             "time.sleep(60)\n")
    with Terminal(work, store, child) as t:
        t.wait(lambda: t.exited() or (work / "ready").exists(), 30, "child started")
        t.type(b"\x1c")  # Ctrl-\\
        t.wait(t.exited, 30, "the wrapper to exit")
        assert os.WIFEXITED(t.status), f"the wrapper itself died of a signal: {t.out.decode(errors='replace')[-1500:]}"
        assert os.WEXITSTATUS(t.status) == 128 + signal.SIGQUIT
        assert store_tree(store) == {"c/a.json": b"a"}
