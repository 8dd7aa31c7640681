"""The process runner: start the wrapped command, forward signals, report its exact exit status.

The child inherits stdio and has the kernel send it SIGKILL if the wrapper dies
(``PR_SET_PDEATHSIG``): a host must never go on running while nothing mirrors its state. SIGKILL,
not SIGTERM: a child that ignores SIGTERM would run on, and nothing is left to escalate once the
wrapper is gone. The wrapper only dies without its own orderly stop when it is SIGKILLed itself (or
crashes), and then nothing would mirror what a gracefully stopping child still writes anyway.
(The signal follows the death of the *thread* that spawned the child: the event loop's, the main
thread.) It reaches the direct child only: processes the child started live on after a SIGKILL of
the wrapper unless the wrapper is the container's PID 1, whose death ends every process in it.

A stop signal forwarded to the child (SIGTERM; SIGINT too when the child has a process group of its
own) is followed by SIGKILL after :data:`DEFAULT_STOP_GRACE` seconds if the child is still running, so a
child that ignores it cannot keep the wrapper (and the pod) waiting for ever. The grace must exceed
the host's own: the agent host waits up to 30 s for requests in flight after SIGTERM. Set it with
``SIDECAR_CHILD_STOP_GRACE`` (seconds, default 35); keep ``terminationGracePeriodSeconds`` above
it plus ``--drain-timeout``.

It runs in a process group of its own, so signals reach it once, through us, and reach the
helpers it starts too; except when the wrapper holds a terminal (``docker run -it``, a shell).
Then the child stays in the wrapper's group, the terminal's foreground group: a group of its own
would be a background one, stopped (SIGTTIN) for good when it reads the terminal. Job control then
works as for any command (Ctrl-Z stops both, ``fg`` resumes both), and SIGINT is not forwarded:
the terminal has sent Ctrl-C to the child as well as to us (a SIGINT sent to the wrapper alone is
therefore not passed on in that mode: use SIGTERM). Ctrl-\\ (SIGQUIT) is ignored by the wrapper
then, so that it reaches the child only and the wrapper still flushes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
DEFAULT_STOP_GRACE = 35.0




try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):  # pragma: no cover
    _prctl = None


class SpawnError(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _child_setup(parent_pid: int, own_group: bool) -> None:
    # Runs in the child between fork and exec: only async-signal-safe work, prepared beforehand.
    if own_group:
        os.setpgid(0, 0)  # a process group of its own (uvloop has no process_group= argument)
    else:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)  # ignored by the wrapper only
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # cannot be ignored: see the module's docstring
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)


def exit_code(returncode: int) -> int:
    """A shell-style exit status: the child's code, or 128+N when it died of signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _holds_terminal() -> bool:
    """Whether stdin is a terminal whose foreground process group is ours."""
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


class Child:
    def __init__(self, proc: asyncio.subprocess.Process, own_group: bool = True,
                 grace: float = DEFAULT_STOP_GRACE) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.own_group = own_group
        self._kill_timer: asyncio.TimerHandle | None = None
        self.grace = grace  # seconds between a forwarded stop signal and SIGKILL

    @classmethod
    async def spawn(cls, argv: list[str], env: dict[str, str] | None = None,
                    grace: float = DEFAULT_STOP_GRACE) -> "Child":
        parent = os.getpid()
        own_group = not _holds_terminal()
        if not own_group:
            signal.signal(signal.SIGQUIT, signal.SIG_IGN)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=None, stdout=None, stderr=None,  # inherited
                env=env,
                preexec_fn=lambda: _child_setup(parent, own_group),
            )
        except FileNotFoundError:
            raise SpawnError(f"command not found: {argv[0]}", 127) from None
        except PermissionError:
            raise SpawnError(f"command not executable: {argv[0]}", 126) from None
        except OSError as e:
            raise SpawnError(f"cannot start {argv[0]}: {e.strerror}", 126) from None
        return cls(proc, own_group, grace)

    def send(self, sig: int) -> None:
        """Signal the child's process group (it leads one), so helpers it started hear it too. A
        stop signal is followed by SIGCONT, as systemd does: a stopped child acts on it."""
        if self.proc.returncode is not None:
            return
        if sig == signal.SIGTERM or (sig == signal.SIGINT and self.own_group):
            self._arm_kill()
        if not self.own_group:  # sharing our terminal's group: see the module's docstring
            if sig != signal.SIGINT:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, sig)
            return
        for s in (sig, signal.SIGCONT) if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) else (sig,):
            try:
                os.killpg(self.pid, s)
            except ProcessLookupError:
                pass
            except PermissionError:
                os.kill(self.pid, s)

    def _arm_kill(self, grace: float | None = None) -> None:
        """SIGKILL the child (its group) in ``grace`` seconds unless it has exited by then."""
        if self._kill_timer is not None:
            return
        grace = self.grace if grace is None else grace
        self._kill_timer = asyncio.get_running_loop().call_later(grace, self._kill_now, grace)

    def _kill_now(self, grace: float) -> None:
        if self.proc.returncode is not None:
            return
        from sidecar import log

        log.warning("child_killed", pid=self.pid, grace_seconds=grace,
                    detail=f"still running {grace:g}s after the stop signal (SIDECAR_CHILD_STOP_GRACE): SIGKILL")
        for kill in ((os.killpg, os.kill) if self.own_group else (os.kill,)):
            try:
                kill(self.pid, signal.SIGKILL)
                return
            except ProcessLookupError:
                return
            except PermissionError:
                continue

    async def end_group(self, timeout: float = 2.0) -> None:
        """Once the child has exited: SIGTERM whatever it left running in its process group
        (helpers it started and did not stop), as an init would, and wait up to ``timeout`` for
        them to be gone (what they write as they stop is then mirrored); nothing if none is left."""
        if not self.own_group:
            return  # our own group: an interactive session's helpers are its user's to end
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            try:  # as PID 1 the helpers are ours to reap, or they would stay as zombies
                while os.waitpid(-self.pid, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                pass
            try:
                os.killpg(self.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            await asyncio.sleep(0.01)

    async def wait(self) -> int:
        try:
            return exit_code(await self.proc.wait())
        finally:
            if self.proc.returncode is not None and self._kill_timer is not None:
                self._kill_timer.cancel()
