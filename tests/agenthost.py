"""Test harness for the real Agent Framework host (examples/approval_agent/app.py).

The host runs in its own virtual environment (pinned by ``tests/agent_stacks/constraints-<stack>.txt``)
as a child process in a new session (its own process group), optionally behind a wrapper command
such as ``python -m sidecar run --store X --``. The test process talks to it over HTTP on 127.0.0.1
with httpx.

Nothing here sleeps for synchronisation: every wait is a poll with a deadline.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from support import wait_for as _wait_for

REPO_ROOT = Path(__file__).resolve().parent.parent
STACKS_DIR = REPO_ROOT / "tests" / "agent_stacks"
APPROVAL_APP = REPO_ROOT / "examples" / "approval_agent" / "app.py"

STACKS = ("issue", "latest", "today")
HOSTING_DIST = "agent-framework-foundry-hosting"

#: The sample workflow's final output for a given decision.
DONE_PREFIX = "Completed with decision: "

#: Poll interval while waiting on a deadline.
POLL = 0.05

#: ``(what, label, seconds)`` for every start-to-ready and stop-to-exit, for the e2e summary.
TIMINGS: list[tuple[str, str, float]] = []


# ---------------------------------------------------------------------------------------------
# Virtual environments
# ---------------------------------------------------------------------------------------------


def constraints_file(stack: str) -> Path:
    if stack not in STACKS:
        raise ValueError(f"unknown agent stack {stack!r}; expected one of {STACKS}")
    return STACKS_DIR / f"constraints-{stack}.txt"


def pinned_version(stack: str, dist: str = HOSTING_DIST) -> str | None:
    """The version ``dist`` is pinned to in the stack's constraints file."""
    wanted = dist.lower().replace("_", "-")
    for line in constraints_file(stack).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = (part.strip() for part in line.split("==", 1))
            if name.lower().replace("_", "-") == wanted:
                return version
    return None


def cache_root() -> Path:
    """Where the project's environments are cached, outside the clone (``scripts/lib/env.sh``'s
    ``CACHE_ROOT``): ``$SIDECAR_CACHE``, else ``$XDG_CACHE_HOME`` or ``~/.cache``, ``/checkpoint-sidecar``."""
    explicit = os.environ.get("SIDECAR_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "checkpoint-sidecar"


def venv_dir(stack: str) -> Path:
    """``$AGENT_VENV_<STACK>``, else the cached venv keyed by the stack's constraints file (as
    ``scripts/lib/env.sh``'s ``agent_venv`` names it)."""
    override = os.environ.get(f"AGENT_VENV_{stack.upper()}")
    if override:
        return Path(override).expanduser().resolve()
    digest = hashlib.sha256(constraints_file(stack).read_bytes()).hexdigest()[:12]
    return cache_root() / f"agent-{stack}-{digest}"


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _installed_version(python: Path, dist: str = HOSTING_DIST) -> str | None:
    proc = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def ensure_venv(stack: str) -> str:
    """Path of the python of the ``stack`` agent venv (one of :data:`STACKS`); builds it if missing.

    ``AGENT_VENV_<STACK>`` (``AGENT_VENV_ISSUE``, ...) points at an existing (or to-be-created) venv;
    the default is :func:`venv_dir`'s cached one. A missing venv is created with
    ``python -m venv`` and ``pip install -r tests/agent_stacks/constraints-<stack>.txt``
    under a file lock, so concurrent test processes build it once.
    """
    constraints = constraints_file(stack)
    venv = venv_dir(stack)
    python = _venv_python(venv)
    want = pinned_version(stack)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # a venv this harness or scripts/demo built is marked once whole; one named by
        # AGENT_VENV_<STACK> is the caller's, never removed while it has a python
        given = bool(os.environ.get(f"AGENT_VENV_{stack.upper()}")) and python.exists()
        if not given and not (venv / ".installed").exists():
            if venv.exists():
                shutil.rmtree(venv)  # a half-built venv from an interrupted run
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            proc = subprocess.run(
                [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-r", str(constraints)],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                shutil.rmtree(venv, ignore_errors=True)
                raise RuntimeError(
                    f"could not build the {stack!r} agent venv at {venv} from {constraints}:\n"
                    f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
                )
            (venv / ".installed").touch()
    have = _installed_version(python)
    if have != want:
        raise RuntimeError(
            f"the {stack!r} agent venv at {venv} has {HOSTING_DIST}=={have}, but {constraints.name} pins {want}; "
            f"delete the venv (or point AGENT_VENV_{stack.upper()} elsewhere) to rebuild it"
        )
    return str(python)


# ---------------------------------------------------------------------------------------------
# Ports and processes
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ... ; comm may contain spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, pgid)`` of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def _tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _proc_stat(int(entry))) and st[0] != "Z":
            children.setdefault(st[1], []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def wait_for(predicate, timeout: float, what: str, diagnostics=lambda: ""):
    """Poll ``predicate`` until it returns a truthy value (returned) or the deadline passes."""
    return _wait_for(predicate, timeout, what, diagnostics, interval=POLL)


# ---------------------------------------------------------------------------------------------
# Responses protocol
# ---------------------------------------------------------------------------------------------

TERMINAL_EVENTS = frozenset({"response.completed", "response.failed", "response.incomplete"})


@dataclass
class Outcome:
    """The terminal state of one ``POST /responses`` call."""

    status: str  # "completed", "failed", ...
    response: dict[str, Any]
    events: list[str] = field(default_factory=list)  # SSE event types, for streamed calls

    @property
    def id(self) -> str:
        return self.response.get("id") or self.response.get("response_id") or ""

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response.get("output") or []

    @property
    def text(self) -> str:
        """Concatenated ``output_text`` of all message items."""
        parts = []
        for item in self.output:
            if item.get("type") == "message":
                for content in item.get("content") or []:
                    if content.get("type") == "output_text":
                        parts.append(content.get("text") or "")
        return "".join(parts)

    @property
    def error(self) -> dict[str, Any] | None:
        return self.response.get("error")

    def __str__(self) -> str:  # what shows up in assertion messages
        if self.status == "completed":
            return f"completed: {self.text!r}"
        return f"{self.status}: {json.dumps(self.error)}"


def parse_sse(lines) -> list[tuple[str, dict[str, Any]]]:
    """``(event, data)`` pairs from an iterable of SSE lines (``data`` JSON-decoded)."""
    events: list[tuple[str, dict[str, Any]]] = []
    name, data = "", []
    for line in list(lines) + [""]:
        line = line.rstrip("\r")
        if not line:
            if data:
                payload = json.loads("\n".join(data))
                events.append((name or payload.get("type", ""), payload))
            name, data = "", []
        elif line.startswith(":"):
            continue  # comment / keep-alive
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    return events


# ---------------------------------------------------------------------------------------------
# The host
# ---------------------------------------------------------------------------------------------


class AgentHost:
    """One run of the agent host (optionally behind a wrapper) in ``cwd``.

    ``env`` is added on top of the test process's environment (``None`` values remove a
    variable). The host binds 127.0.0.1:``port`` and runs in local mode (no
    ``FOUNDRY_HOSTING_ENVIRONMENT``) with the hosting SDK's telemetry setup disabled.
    """

    _seq = 0

    def __init__(
        self,
        cwd: str | os.PathLike[str],
        python: str,
        app: str | os.PathLike[str] = APPROVAL_APP,
        port: int | None = None,
        env: dict[str, str | None] | None = None,
        wrapper: list[str] | None = None,
    ) -> None:
        self.cwd = Path(cwd)
        self.python = python
        self.app = str(app)
        self.port = port or free_port()
        self.wrapper = list(wrapper or [])
        self.base_url = f"http://127.0.0.1:{self.port}"
        AgentHost._seq += 1
        self.log_path = self.cwd / f"agenthost-{AgentHost._seq}-{self.port}.log"
        merged = dict(os.environ)
        merged.pop("FOUNDRY_HOSTING_ENVIRONMENT", None)
        merged.update(
            PORT=str(self.port),
            HOST="127.0.0.1",
            AGENT_OBSERVABILITY="0",
            PYTHONUNBUFFERED="1",
            PYTHONDONTWRITEBYTECODE="1",
            APPLICATIONINSIGHTS_STATSBEAT_DISABLED_ALL="true",  # its exporter would reach a public endpoint
        )
        for key, value in (env or {}).items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = value
        self.env = merged
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self.started_at = 0.0
        self.ready_after: float | None = None  # seconds from start() to ready
        self.stopped_after: float | None = None  # seconds from the stop signal to exit
        self._client = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(30.0, connect=2.0))

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def label(self) -> str:
        """E.g. ``agent-issue`` or ``wrapped agent-issue``, for timing summaries."""
        venv = Path(self.python).parent.parent.name
        return f"wrapped {venv}" if self.wrapper else venv

    @property
    def command(self) -> list[str]:
        return [*self.wrapper, self.python, self.app]

    def start(self) -> AgentHost:
        assert self.proc is None, "already started"
        with open(self.log_path, "ab") as log:
            log.write(f"$ (cd {self.cwd} && {' '.join(self.command)})  # port {self.port}\n".encode())
            log.flush()
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                self.command,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: kill() takes wrapper and host together
            )
        return self

    @property
    def pgid(self) -> int:
        assert self.proc is not None
        return self.proc.pid  # session leader

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 30.0) -> AgentHost:
        """Poll ``GET /readiness`` until it answers 200; fails early if the process exits."""
        assert self.proc is not None, "not started"

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"agent host exited with {self.proc.returncode} before it was ready{self.log_tail()}"
                )
            try:
                return self._client.get("/readiness", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout, f"{self.base_url}/readiness", self.log_tail)
        self.ready_after = time.monotonic() - self.started_at
        TIMINGS.append(("start->ready", self.label, self.ready_after))
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send ``sig`` to the top process (wrapper or host) and wait for it and its group to exit.

        Returns the exit code. Fails (after SIGKILLing the group) if the process does not exit
        in time or if any process of its group outlives it.
        """
        assert self.proc is not None, "not started"
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"agent host did not exit within {timeout}s of signal {sig}{self.log_tail()}") from None
        self.stopped_after = time.monotonic() - t0
        TIMINGS.append((f"signal {signal.Signals(sig).name}->exit", self.label, self.stopped_after))
        try:
            wait_for(lambda: not _group_members(self.pgid), 5.0, "the process group to exit")
        except AssertionError:
            leftovers = _group_members(self.pgid)
            self._killpg()
            raise AssertionError(
                f"processes {leftovers} of the agent host's group outlived its top process "
                f"(exit {self.returncode}){self.log_tail()}"
            ) from None
        return self.returncode

    def _killpg(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)

    def kill(self) -> None:
        """Wrapper and host die at the same instant, as when the compute goes away.

        The sidecar runs the host in a process group of its own (with ``PR_SET_PDEATHSIG``), so
        every process group of the tree is frozen (SIGSTOP) first, then SIGKILLed; otherwise the
        host would get the kernel's SIGTERM and shut down gracefully while the test goes on.
        """
        if self.proc is None:
            return
        tree = _tree(self.proc.pid)
        groups = {st[2] for p in tree if (st := _proc_stat(p))} | {self.pgid}
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for group in groups:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, sig)
        self.returncode = self.proc.wait(10)
        wait_for(lambda: all((st := _proc_stat(p)) is None or st[0] == "Z" for p in tree), 5.0,
                 f"processes {tree} to die")
        wait_for(lambda: not _group_members(self.pgid), 5.0, "the killed process group to disappear")

    def close(self) -> None:
        """Best-effort cleanup for fixtures: kill whatever is left and close the HTTP client."""
        try:
            if self.proc is not None and (self.proc.poll() is None or _group_members(self.pgid)):
                self.kill()
        finally:
            self._client.close()

    # -- diagnostics ----------------------------------------------------------------------------

    @property
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        text = self.log.splitlines()[-lines:]
        return f"\n--- {self.log_path} (last {len(text)} lines) ---\n" + "\n".join(text)

    # -- Responses protocol ---------------------------------------------------------------------

    def post(self, body: dict[str, Any], user: str | None = None, stream: bool = False) -> Outcome:
        """``POST /responses`` and return its terminal state (JSON or the terminal SSE event)."""
        headers = {"x-agent-user-id": user} if user else {}
        body = {**body, "stream": True} if stream else body
        if not stream:
            r = self._client.post("/responses", json=body, headers=headers)
            if r.status_code != 200:
                raise AssertionError(f"POST /responses -> HTTP {r.status_code}: {r.text[:2000]}{self.log_tail()}")
            data = r.json()
            return Outcome(status=data.get("status", ""), response=data)
        with self._client.stream("POST", "/responses", json=body, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                raise AssertionError(f"POST /responses -> HTTP {r.status_code}: {r.text[:2000]}{self.log_tail()}")
            events = parse_sse(r.iter_lines())
        names = [name for name, _ in events]
        terminal = [(name, data) for name, data in events if name in TERMINAL_EVENTS]
        if not terminal:
            raise AssertionError(f"stream ended without a terminal event; got {names}{self.log_tail()}")
        name, data = terminal[-1]
        response = data.get("response") or {}
        return Outcome(status=response.get("status") or name.rsplit(".", 1)[-1], response=response, events=names)

    def first_request(self, user: str | None = None, stream: bool = False, text: str = "ship it") -> tuple[str, str]:
        """Start the approval workflow; returns ``(response_id, call_id)`` of its ``request_info`` call."""
        outcome = self.post({"input": text}, user=user, stream=stream)
        calls = [item for item in outcome.output if item.get("type") == "function_call"]
        assert outcome.status == "completed" and len(calls) == 1 and calls[0].get("name") == "request_info", (
            f"expected one request_info function_call, got {outcome} {json.dumps(outcome.output)[:2000]}"
            f"{self.log_tail()}"
        )
        assert outcome.id and calls[0].get("call_id"), outcome.response
        return outcome.id, calls[0]["call_id"]

    def continue_(
        self,
        response_id: str,
        call_id: str,
        output: str = "approved",
        user: str | None = None,
        stream: bool = False,
    ) -> Outcome:
        """Answer the pending ``request_info`` call; returns the terminal state (text or failure)."""
        body = {
            "previous_response_id": response_id,
            "input": [{"type": "function_call_output", "call_id": call_id, "output": output}],
        }
        return self.post(body, user=user, stream=stream)

    def __enter__(self) -> AgentHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
