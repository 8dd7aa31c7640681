"""The process runner: start the wrapped command, forward signals, report its exact exit status.

The child inherits stdio, runs in its own process group (so signals reach it once, through us,
not twice), and has the kernel send it SIGTERM if the wrapper dies (``PR_SET_PDEATHSIG``): a host
must never go on running while nothing mirrors its state. When the wrapper holds the terminal
(``docker run -it``, a shell), the child's group is given the terminal: a background group that
reads it would be stopped (SIGTTIN) for good, and Ctrl-C then reaches the child directly.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1

try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):  # pragma: no cover
    _prctl = None


class SpawnError(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _child_setup(parent_pid: int, take_terminal: bool) -> None:
    # Runs in the child between fork and exec: only async-signal-safe work, prepared beforehand.
    os.setpgid(0, 0)  # a process group of its own (uvloop has no process_group= argument)
    if take_terminal:
        # from a background group tcsetpgrp raises SIGTTOU: ignored for the call, then restored
        # (an ignored disposition would survive exec)
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        try:
            os.tcsetpgrp(0, os.getpgrp())
        except OSError:
            pass
        signal.signal(signal.SIGTTOU, signal.SIG_DFL)
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
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
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid = proc.pid

    @classmethod
    async def spawn(cls, argv: list[str], env: dict[str, str] | None = None) -> "Child":
        parent = os.getpid()
        take_terminal = _holds_terminal()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=None, stdout=None, stderr=None,  # inherited
                env=env,
                preexec_fn=lambda: _child_setup(parent, take_terminal),
            )
        except FileNotFoundError:
            raise SpawnError(f"command not found: {argv[0]}", 127) from None
        except PermissionError:
            raise SpawnError(f"command not executable: {argv[0]}", 126) from None
        except OSError as e:
            raise SpawnError(f"cannot start {argv[0]}: {e.strerror}", 126) from None
        return cls(proc)

    def send(self, sig: int) -> None:
        """Signal the child's process group (it leads one), so helpers it started hear it too. A
        stop signal is followed by SIGCONT, as systemd does: a stopped child (Ctrl-Z) acts on it."""
        if self.proc.returncode is None:
            for s in (sig, signal.SIGCONT) if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) else (sig,):
                try:
                    os.killpg(self.pid, s)
                except ProcessLookupError:
                    pass
                except PermissionError:
                    os.kill(self.pid, s)

    def end_group(self) -> None:
        """Once the child has exited: SIGTERM whatever it left running in its process group
        (helpers it started and did not stop), as an init would; nothing if none is left."""
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass

    async def wait(self) -> int:
        return exit_code(await self.proc.wait())
