"""The recovery story: a paused workflow survives losing its disk and its process.

1. The sample approval agent runs under ``checkpoint-sidecar run --`` (directory store).
2. ``POST /responses {"input": "ship it"}`` pauses the workflow on ``request_info``.
3. The host is stopped and its ``.checkpoints`` / ``.function_approvals`` are deleted: what the
   platform does when it recreates an idle session's compute.
4. The host starts again under the sidecar, which restores the state before the host starts.
5. The continuation (``function_call_output`` = "approved") completes.
The same steps without the sidecar are run first, to show the failure being fixed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from agenthost import AgentHost, ensure_venv  # noqa: E402  (the same harness the tests use)


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def story(python: str, workdir: Path, wrapper: list[str] | None, label: str) -> str:
    say(f"--- {label} ---")
    host = AgentHost(workdir, python, wrapper=wrapper).start().wait_ready(60)
    rid, call_id = host.first_request()
    say(f"first request paused on request_info: response {rid}, call {call_id}")
    host.stop()
    for name in (".checkpoints", ".function_approvals"):
        shutil.rmtree(workdir / name, ignore_errors=True)
    say("host stopped and its local state deleted (compute recreated)")
    host = AgentHost(workdir, python, wrapper=wrapper).start().wait_ready(60)
    outcome = host.continue_(rid, call_id, "approved")
    host.stop()
    say(f"continuation: {outcome.status}: {outcome.text or outcome.error}")
    return outcome.text or ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", help="directory store (default: the sidecar's default, with a fresh prefix)")
    p.add_argument("--skip-control", action="store_true", help="skip the run without the sidecar")
    args = p.parse_args()
    python = ensure_venv("issue")
    sidecar = [sys.executable, "-m", "sidecar", "run", "--http-addr", ""]
    if args.store:
        sidecar += ["--store", args.store]
    sidecar += ["--prefix", f"demo-{int(time.time())}", "--"]
    with tempfile.TemporaryDirectory(prefix="sidecar-demo-") as tmp:
        if not args.skip_control:
            (Path(tmp) / "bare").mkdir()
            text = story(python, Path(tmp) / "bare", None, "without the sidecar")
            say("as expected, the workflow could not resume" if "approved" not in text else "unexpected: resumed")
        (Path(tmp) / "wrapped").mkdir()
        text = story(python, Path(tmp) / "wrapped", sidecar, "under checkpoint-sidecar run --")
    if text.endswith("Completed with decision: approved"):
        say("recovered: the paused workflow completed after compute recreation")
        return 0
    say("FAILED: the continuation did not complete")
    return 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(REPO))
    raise SystemExit(main())
