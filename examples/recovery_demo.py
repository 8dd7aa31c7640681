"""The recovery story: a paused workflow survives losing its disk and its process.

1. The sample approval agent runs under ``checkpoint-sidecar run --`` (directory store).
2. ``POST /responses {"input": "ship it"}`` pauses the workflow on ``request_info``; the sidecar
   mirrors the checkpoint the host writes.
3. The host is stopped and its ``.checkpoints`` / ``.function_approvals`` are deleted: what the
   platform does when it recreates an idle session's compute.
4. The host starts again under the sidecar, which restores the state before the host starts.
5. The continuation (``function_call_output`` = "approved") completes.

The same steps without the sidecar show the failure being fixed. Both runs go at once (their
lines are printed one run after the other). Lines marked ``[sidecar]`` are the sidecar's own log
lines as an operator sees them (its default level, text format), picked out of the log it shares
with the host. The driver runs in the agent host's virtual environment; the sidecar is the
``checkpoint-sidecar`` given by ``--sidecar``. The store is a temporary directory, removed at the end, unless
``--store DIR`` names one to keep.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from agenthost import AgentHost, ensure_venv, wait_for  # noqa: E402  (the harness the tests use)

#: The namespace inside the store that the demo's sidecar uses.
PREFIX = "demo"

#: The agent host's environment: no telemetry leaves the machine.
HOST_ENV = {"AGENT_OBSERVABILITY": "0", "APPLICATIONINSIGHTS_STATSBEAT_DISABLED_ALL": "true"}


#: One line of the sidecar's text log (``SIDECAR_LOG_FORMAT=text``): time, level, event, fields.
SIDECAR_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} (debug|info|warning|error)\s+(\S+)")


def sidecar_lines(log: str) -> list[tuple[str, str]]:
    """The sidecar's own lines in a log it shares with the host, as (event, line)."""
    return [(m[2], line) for line in log.splitlines() if (m := SIDECAR_LINE.match(line))]


class Story:
    """One run of the story; its lines go to ``out`` (a queue the main thread prints from)."""

    def __init__(self, label: str, python: str, workdir: Path, wrapper: list[str] | None, env: dict) -> None:
        self.label, self.python, self.workdir, self.wrapper, self.env = label, python, workdir, wrapper, env
        self.out: queue.Queue[str | None] = queue.Queue()
        self.text = ""
        self.failure: BaseException | None = None
        self._seen = 0

    def say(self, msg: str) -> None:
        self.out.put(f"[demo] {msg}")

    def sidecar_events(self, host: AgentHost, until: Callable[[list[str]], bool] | None = None) -> list[str]:
        """Print the sidecar's new log lines (polling, with a deadline, until ``until`` holds for
        their events)."""
        if self.wrapper is None:
            return []
        lines: list[tuple[str, str]] = []

        def fresh() -> bool:
            nonlocal lines
            lines = sidecar_lines(host.log)[self._seen:]
            return until is None or until([event for event, _ in lines])

        wait_for(fresh, 15.0, "the sidecar's log line", host.log_tail)
        self._seen += len(lines)
        for _, line in lines:
            self.out.put(f"[sidecar] {line}")
        return [event for event, _ in lines]

    def start(self) -> AgentHost:
        self._seen = 0
        host = AgentHost(self.workdir, self.python, wrapper=self.wrapper, env=self.env).start().wait_ready(60)
        self.sidecar_events(host, lambda ev: "child_started" in ev)
        self.say(f"host ready at {host.base_url}")
        return host

    def run(self) -> None:
        try:
            self.say(f"--- {self.label} ---")
            host = self.start()
            rid, call_id = host.first_request()
            self.say(f"first request paused on request_info: response {rid}, call {call_id}")
            host.stop()
            self.sidecar_events(host, lambda ev: "shutdown_flushed" in ev or "shutdown_pending" in ev)
            for name in (".checkpoints", ".function_approvals"):
                shutil.rmtree(self.workdir / name, ignore_errors=True)
            self.say("host stopped, .checkpoints and .function_approvals deleted (the compute is recreated)")
            host = self.start()
            outcome = host.continue_(rid, call_id, "approved")
            host.stop()
            self.sidecar_events(host, lambda ev: "shutdown_flushed" in ev or "shutdown_pending" in ev)
            self.say(f"continuation: {outcome.status}: {outcome.text or outcome.error}")
            self.text = outcome.text or ""
        except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
            self.failure = exc
        finally:
            self.out.put(None)

    def print_lines(self) -> None:
        while (line := self.out.get()) is not None:
            print(line, flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", type=Path, help="directory store to use and keep (default: a temporary one)")
    p.add_argument("--skip-control", action="store_true", help="skip the run without the sidecar")
    p.add_argument("--sidecar", default=None,
                   help="the checkpoint-sidecar command (default: this Python's -m sidecar, from this checkout)")
    args = p.parse_args()
    python = ensure_venv("issue")
    # The demo's own settings only: a SIDECAR_* variable of the caller's shell plays no part.
    env: dict[str, str | None] = {k: None for k in os.environ if k.upper().startswith("SIDECAR_")}
    env.update(HOST_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="sidecar-demo-") as tmp:
        store = args.store.resolve() if args.store else Path(tmp) / "store"
        kept = "kept" if args.store else "removed at the end"
        print(f"[demo] store: {store}/{PREFIX} (a directory store, {kept})", flush=True)
        wrapped_env = dict(env, SIDECAR_LOG_FORMAT="text")  # its default level: what an operator sees
        command = [args.sidecar] if args.sidecar else [sys.executable, "-m", "sidecar"]
        sidecar = [*command, "run", "--http-addr", "", "--store", str(store), "--prefix", PREFIX, "--"]
        stories = []
        if not args.skip_control:
            (Path(tmp) / "bare").mkdir()
            stories.append(Story("1. without the sidecar", python, Path(tmp) / "bare", None, env))
        (Path(tmp) / "wrapped").mkdir()
        wrapped = Story(f"{len(stories) + 1}. under checkpoint-sidecar run --", python, Path(tmp) / "wrapped",
                        sidecar, wrapped_env)
        stories.append(wrapped)
        threads = [threading.Thread(target=s.run, daemon=True) for s in stories]
        for t in threads:
            t.start()
        for story in stories:
            story.print_lines()
            if story is not wrapped and story.failure is None:
                resumed = "approved" in story.text
                print("[demo] unexpected: resumed without the sidecar" if resumed else
                      "[demo] as expected, the workflow could not resume: its checkpoint went with the disk",
                      flush=True)
        for t in threads:
            t.join()
        for story in stories:
            if story.failure is not None:
                print(f"[demo] FAILED ({story.label}): {story.failure}", flush=True)
                return 1
    if wrapped.text.endswith("Completed with decision: approved"):
        print("[demo] recovered: the paused workflow completed after compute recreation", flush=True)
        if args.store:
            print(f"[demo] the store is kept in {store}; remove it with: rm -r {store}", flush=True)
        return 0
    print("[demo] FAILED: the continuation did not complete", flush=True)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
