"""The newest hosting stack (state under ``$AGENTSERVER_STATE_ROOT``) behind ``sidecar run --layout agentserver``.

Hosting ≥ 1.0.0b260813 outside Foundry keeps every piece of state in one tree, the state root
(``$AGENTSERVER_STATE_ROOT``, default ``~/.agentserver``): ``state_stores/`` (checkpoints, workflow
bindings), ``responses/``, ``tasks/`` (resilient background tasks) and ``streams/``. Recreating
the compute loses the tree; the sidecar mirrors it to the store (under the root's basename) and
restores it before the host starts.

a) A paused workflow (examples/approval_agent) is continued after the state root is gone: on the
   pinned newest stack and on the stack a plain install resolves today (core 1.26.0), on a
   directory and on Azure (Azurite).
b) A *running* background response (examples/resilient_agent, five stages) survives two crashes
   (SIGKILL of sidecar and host together, then the state root deleted), one in stage two and
   one in stage four, and completes with its one output item; with ``"stream": true`` too.

Each has a control without the sidecar that fails.

Nothing here sleeps for synchronisation: every wait is a poll with a deadline.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import agenthost
from agenthost import DONE_PREFIX, REPO_ROOT, TERMINAL_EVENTS, AgentHost, parse_sse, wait_for
from tests.e2e.stacks import Stack, StoreView, disk_files

pytestmark = pytest.mark.e2e

RESILIENT_APP = REPO_ROOT / "examples" / "resilient_agent" / "app.py"
APPROVED = DONE_PREFIX + "approved"
STAGES = ("one", "two", "three", "four", "five")
ALL_STAGES = "stages: " + ",".join(STAGES)
#: Short enough for a fast suite, long enough that "the store caught up with stage N" reliably
#: happens while stage N is still running (the sidecar commits within tens of milliseconds).
STAGE_SECONDS = 0.75
#: Everything below waits at most this long for one step (host start excluded).
STEP_TIMEOUT = 20.0


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def agentserver_wrapper(store: Path) -> list[str]:
    store.mkdir(parents=True, exist_ok=True)  # a mounted volume: with a session id a missing store is refused
    return [
        sys.executable, "-m", "sidecar", "run", "--layout", "agentserver", "--http-addr", "", "--store", str(store), "--",
    ]


def store_name(path: Path) -> str:
    """``state_stores/<base64url(name)>.json`` -> ``name``."""
    stem = path.name[: -len(".json")]
    return base64.urlsafe_b64decode(stem + "=" * (-len(stem) % 4)).decode()


def read_state_stores(root: Path) -> dict[str, dict[str, Any]] | None:
    """``{store name: items}`` of a state root (or of its copy in the store); None while unreadable."""
    stores: dict[str, dict[str, Any]] = {}
    for path in sorted((root / "state_stores").glob("*.json")):
        try:
            stores[store_name(path)] = json.loads(path.read_text())["items"]
        except (OSError, ValueError, KeyError):
            return None  # being replaced right now; the next poll sees the new file
    return stores


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


# -- (a) the approval workflow ----------------------------------------------------------------


def assert_approved(outcome, host: AgentHost) -> None:
    assert outcome.status == "completed" and outcome.text == APPROVED, f"continuation {outcome}{host.log_tail()}"


# -- (b) the resilient workflow ---------------------------------------------------------------

#: A checkpoint's pending messages are keyed by the executor that sent them: messages from
#: ``stage_one`` mean stage two runs next (or is running).
NEXT_STAGE = {"start": "one", **{f"stage_{a}": b for a, b in zip(STAGES, STAGES[1:], strict=False)}}


def _response_key(response_id: str) -> str:
    return "response-" + hashlib.sha256(response_id.encode()).hexdigest()


def recoverable_stage(root: Path, response_id: str) -> str | None:
    """Where recovery from ``root`` would resume ``response_id``.

    The native workflow host pairs every response with one checkpoint (store
    ``workflow_bindings/v2/<scope>``, item ``response-<sha256(id)>``); recovery restores exactly
    that checkpoint. Returns the stage that runs next from it, ``"done"`` once the pair is
    completed, or None when there is no recoverable pair (yet): before the first pair is written
    a crash fails closed (the response ends ``failed``).
    """
    stores = read_state_stores(root)
    if not stores:
        return None
    key = _response_key(response_id)
    for name, items in stores.items():
        if not name.startswith("workflow_bindings/") or key not in items:
            continue
        record = items[key]["value"]
        if record.get("status") == "completed":
            return "done"
        checkpoint_id = (record.get("binding") or {}).get("checkpoint_id")
        if record.get("status") != "active" or not checkpoint_id or not record.get("snapshot"):
            return None
        for other, checkpoints in stores.items():
            if other.startswith("checkpoints/") and checkpoint_id in checkpoints:
                senders = [s for s, msgs in checkpoints[checkpoint_id]["value"].get("messages", {}).items() if msgs]
                return NEXT_STAGE.get(senders[0]) if len(senders) == 1 else None
    return None


def holds_task(root: Path, response_id: str) -> bool:
    return any((root / "tasks").glob(f"*/*/{response_id}.json"))


class BackgroundStream:
    """``POST /responses`` with ``"stream": true`` read on a thread until the host goes away."""

    def __init__(self, host: AgentHost, body: dict[str, Any]) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.error: BaseException | None = None
        self._url = host.base_url
        self._body = {**body, "stream": True}
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            timeout = httpx.Timeout(60, connect=2)
            with httpx.stream("POST", f"{self._url}/responses", json=self._body, timeout=timeout) as r:
                r.raise_for_status()
                block: list[str] = []
                for line in r.iter_lines():
                    if line.strip():
                        block.append(line)
                    elif block:
                        self.events.extend(parse_sse(block))
                        block = []
                if block:
                    self.events.extend(parse_sse(block))
        except httpx.HTTPError as exc:  # the host was killed mid-stream
            self.error = exc

    @property
    def response_id(self) -> str | None:
        for name, data in list(self.events):
            if name == "response.created":
                return data["response"]["id"]
        return None

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end after its host was killed"


def start_response(host: AgentHost, stream: bool) -> tuple[str, BackgroundStream | None]:
    body = {"input": "go", "background": True, "store": True}
    if not stream:
        outcome = host.post(body)
        assert outcome.status in ("queued", "in_progress") and outcome.id, f"POST /responses {outcome.response}"
        return outcome.id, None
    reader = BackgroundStream(host, body)
    response_id = wait_for(lambda: reader.response_id, STEP_TIMEOUT, "response.created on the stream", host.log_tail)
    return response_id, reader


def get_response(host: AgentHost, response_id: str, **params: Any) -> httpx.Response:
    return httpx.get(f"{host.base_url}/responses/{response_id}", params=params, timeout=10)


def poll_until_terminal(host: AgentHost, response_id: str, timeout: float) -> dict[str, Any]:
    def terminal():
        r = get_response(host, response_id)
        assert r.status_code == 200, f"GET /responses/{response_id} -> {r.status_code} {r.text[:500]}{host.log_tail()}"
        data = r.json()
        return data if data.get("status") not in ("queued", "in_progress") else None

    return wait_for(terminal, timeout, f"response {response_id} to finish", host.log_tail)


def output_texts(response: dict[str, Any]) -> list[str]:
    """One entry per output item: its text (message items) or its type."""
    texts = []
    for item in response.get("output") or []:
        parts = [c.get("text", "") for c in item.get("content") or [] if c.get("type") == "output_text"]
        texts.append("".join(parts) if item.get("type") == "message" else f"<{item.get('type')}>")
    return texts


def stage_lines(host: AgentHost, what: str) -> list[str]:
    """The stages that logged ``what`` ("started" / "finished") in this host's log, in order."""
    found = []
    for line in host.log.splitlines():
        for stage in STAGES:
            if f"stage {stage} {what}" in line:
                found.append(stage)
    return found


def crash(host: AgentHost) -> None:
    """Sidecar and host die at the same instant, as when the compute goes away."""
    host.kill()


def crash_during(host: AgentHost, stage: str, response_id: str, state_root: Path, store: Path | None) -> None:
    """SIGKILL sidecar and host (process group) while ``stage`` runs, once the store can resume it.

    Waits until the host logs that ``stage`` started and until the state (the store's copy of the
    state root, or without a store the host's own) holds a checkpoint/response pair from which
    ``stage`` runs next (with a store, the task too).
    """
    wait_for(lambda: stage in stage_lines(host, "started"), STEP_TIMEOUT, f"stage {stage} to start", host.log_tail)
    if store is None:  # the control: the host's own state must be able to resume the stage
        wait_for(lambda: recoverable_stage(state_root, response_id) == stage, STEP_TIMEOUT,
                 f"the host's state to be one from which stage {stage} runs",
                 lambda: f"; it resumes at {recoverable_stage(state_root, response_id)!r}{host.log_tail()}")
    else:
        copy = store / state_root.name

        def caught_up() -> bool:
            return holds_task(copy, response_id) and recoverable_stage(copy, response_id) == stage

        wait_for(
            caught_up,
            STEP_TIMEOUT,
            f"the store to hold the state from which stage {stage} runs",
            lambda: f"; store copy resumes at {recoverable_stage(copy, response_id)!r}; "
            f"store holds {files_under(store)}{host.log_tail()}",
        )
    t0 = time.monotonic()
    crash(host)
    agenthost.TIMINGS.append(("SIGKILL->gone", host.label, time.monotonic() - t0))
    assert stage not in stage_lines(host, "finished"), (
        f"the crash was meant to hit stage {stage} while it ran, but it had finished: the store took "
        f"longer than a stage ({STAGE_SECONDS}s) to catch up{host.log_tail()}"
    )


def recreate_compute(state_root: Path) -> None:
    shutil.rmtree(state_root, ignore_errors=True)
    assert not state_root.exists()


# ---------------------------------------------------------------------------------------------
# a) continuation of a paused workflow (approval app)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", ["latest", "today"], indirect=True)
def test_control_continuation_fails_without_state_root(workdir, stack: Stack, start_host):
    first = start_host(workdir, stack.python, env=stack.env)
    response_id, call_id = first.first_request()
    assert first.stop() == 0
    assert stack.holds_pause(disk_files(workdir, stack.roots), response_id, call_id), files_under(workdir)

    stack.recreate_compute(workdir)
    second = start_host(workdir, stack.python, env=stack.env)
    outcome = second.continue_(response_id, call_id)
    assert outcome.status == "failed" and outcome.text != APPROVED, f"continuation {outcome}"
    assert "Cannot find an existing workflow checkpoint" in json.dumps(outcome.error), str(outcome)
    assert second.stop() == 0


@pytest.mark.parametrize(
    "stack,view,stop",
    [
        ("latest", "directory", "sigterm"),
        ("latest", "directory", "sigkill"),
        ("today", "directory", "sigterm"),
        pytest.param("today", "azure", "sigkill", marks=pytest.mark.azure),
    ],
    indirect=["stack", "view"],
)
def test_sidecar_continuation_after_state_root_loss(workdir, stack: Stack, view: StoreView, start_host, sidecar_cli,
                                                    stop):
    env = {**sidecar_cli, **view.env, **stack.env}
    wrapper = [sys.executable, "-m", "sidecar", "run", "--http-addr", "", "--store", view.create().url, "--"]

    first = start_host(workdir, stack.python, env=env, wrapper=wrapper, ready_timeout=60)
    response_id, call_id = first.first_request()
    if stop == "sigterm":
        # The wrapper forwards SIGTERM, flushes, and exits with the host's code.
        assert first.stop(signal.SIGTERM) == 0, first.log_tail()
    else:
        wait_for(
            lambda: stack.holds_pause(view.files(), response_id, call_id),
            STEP_TIMEOUT,
            f"the store to hold the checkpoint pending {call_id}",
            lambda: f"; store holds {sorted(view.files())}{first.log_tail()}",
        )
        crash(first)  # no forwarding, no final flush, no graceful stop of the host
    assert stack.holds_pause(view.files(), response_id, call_id), (
        f"the store must hold the paused checkpoint; it has {sorted(view.files())}{first.log_tail()}"
    )

    stack.recreate_compute(workdir)
    second = start_host(workdir, stack.python, env=env, wrapper=wrapper, ready_timeout=60)
    assert_approved(second.continue_(response_id, call_id), second)
    assert second.stop(signal.SIGTERM) == 0, second.log_tail()


# ---------------------------------------------------------------------------------------------
# b) a running background response survives repeated crashes (resilient app)
# ---------------------------------------------------------------------------------------------


#: Where the resilient app's sidecar keeps its state: the platform names the session, so the
#: sidecar keeps it in <store>/<FOUNDRY_AGENT_NAME>/<FOUNDRY_AGENT_SESSION_ID> (docs/NAMESPACES.md).
RESILIENT_NAMESPACE = ("resilient-e2e", "session-e2e")


def resilient_env(state_root: Path) -> dict[str, str]:
    # FOUNDRY_AGENT_NAME and FOUNDRY_AGENT_SESSION_ID form the task's lease owner
    # ("<name>|session:<id>"); a restarted host only recovers tasks it owns, so they stay the same.
    return {
        "AGENTSERVER_STATE_ROOT": str(state_root),
        "STAGE_SECONDS": str(STAGE_SECONDS),
        "FOUNDRY_AGENT_NAME": "resilient-e2e",
        "FOUNDRY_AGENT_SESSION_ID": "session-e2e",
    }


def test_control_running_response_is_lost_without_state_root(workdir, tmp_path, latest_python, start_host):
    state_root = tmp_path / "state"
    env = resilient_env(state_root)
    first = start_host(workdir, latest_python, env=env, app=RESILIENT_APP)
    response_id, _ = start_response(first, stream=False)
    crash_during(first, "two", response_id, state_root, store=None)
    assert recoverable_stage(state_root, response_id) == "two", "sanity: the local state could resume stage two"

    recreate_compute(state_root)
    second = start_host(workdir, latest_python, env=env, app=RESILIENT_APP)

    def lost():
        r = get_response(second, response_id)
        if r.status_code == 404:
            return True
        assert r.status_code == 200 and r.json().get("status") != "completed", f"{r.status_code} {r.text[:500]}"
        return False

    # 404 at once (responses/ is gone); tolerate a slower "never completes" for up to a full run.
    try:
        wait_for(lost, STAGE_SECONDS * len(STAGES) + 2, "GET to answer 404")
    except AssertionError:
        assert get_response(second, response_id).json().get("status") != "completed"
    assert stage_lines(second, "started") == [], f"nothing may resume without the state{second.log_tail()}"
    assert second.stop() == 0


@pytest.mark.parametrize("stack,stream", [("latest", False), ("latest", True), ("today", False)],
                         ids=["latest-poll", "latest-stream", "today-poll"], indirect=["stack"])
def test_sidecar_recovers_running_response_after_repeated_crashes(
    workdir, tmp_path, stack: Stack, start_host, sidecar_cli, stream
):
    state_root = tmp_path / "state"
    store = tmp_path / "store"
    env = {
        **sidecar_cli,
        **resilient_env(state_root),
        # After a restart the sidecar waits out the previous owner's write window (2 s) plus a
        # clock margin (8 s) before its first upload. The previous sidecar was SIGKILLed, so
        # nothing is draining; shorter values let the second crash come a few stages later
        # rather than ~10 s later (with the defaults, a crash inside that window resumes from
        # the state of the previous crash, which is consistent too: see docs/agentserver.md).
        "SIDECAR_FENCE_WINDOW": "0.5",
        "SIDECAR_FENCE_MARGIN": "0",
    }
    wrapper = agentserver_wrapper(store)

    def start():
        return start_host(workdir, stack.python, env=env, wrapper=wrapper, app=RESILIENT_APP, ready_timeout=60)

    first = start()
    response_id, reader = start_response(first, stream)
    crash_during(first, "two", response_id, state_root, store.joinpath(*RESILIENT_NAMESPACE))
    if reader is not None:
        reader.join(STEP_TIMEOUT)
        names = [name for name, _ in reader.events]
        assert "response.created" in names and not TERMINAL_EVENTS.intersection(names), names

    recreate_compute(state_root)
    t0 = time.monotonic()
    second = start()
    # Resumed from the checkpoint before stage two: stage one does not run again, stage two does.
    wait_for(lambda: "two" in stage_lines(second, "started"), STEP_TIMEOUT, "stage two to run again", second.log_tail)
    assert stage_lines(second, "started")[0] == "two", second.log_tail()
    crash_during(second, "four", response_id, state_root, store.joinpath(*RESILIENT_NAMESPACE))

    recreate_compute(state_root)
    third = start()
    if reader is not None:
        # The background stream replays from the start and ends with the recovered result.
        with httpx.stream(
            "GET", f"{third.base_url}/responses/{response_id}", params={"stream": "true"}, timeout=STEP_TIMEOUT
        ) as r:
            assert r.status_code == 200, r.read()
            events = parse_sse(r.iter_lines())
        terminal = [(name, data) for name, data in events if name in TERMINAL_EVENTS]
        assert terminal and terminal[-1][0] == "response.completed", [name for name, _ in events]
        assert output_texts(terminal[-1][1]["response"]) == [ALL_STAGES], terminal[-1][1]
    final = poll_until_terminal(third, response_id, STAGE_SECONDS * len(STAGES) + STEP_TIMEOUT)
    agenthost.TIMINGS.append(("2 crashes->completed", "resilient", time.monotonic() - t0))
    assert final["status"] == "completed", f"{final.get('status')}: {final.get('error')}{third.log_tail()}"
    assert output_texts(final) == [ALL_STAGES], final.get("output")
    assert stage_lines(third, "started") == ["four", "five"], third.log_tail()
    assert third.stop(signal.SIGTERM) == 0, third.log_tail()


def test_sidecar_second_crash_inside_the_fence_wait_resumes_from_the_first(
    workdir, tmp_path, latest_python, start_host, sidecar_cli
):
    """The sidecar's default fence, and a second crash before the store caught up.

    After a restart the sidecar uploads nothing until the previous owner's write window has
    passed (``fence_window`` 2 s + ``fence_margin`` 8 s after its last heartbeat, the defaults,
    set explicitly here because the e2e fixtures shorten the margin). A crash inside that wait
    finds the store still at the state of the previous crash: the response resumes from there
    (stage two again) and still completes once.
    """
    state_root = tmp_path / "state"
    store = tmp_path / "store"
    env = {**sidecar_cli, **resilient_env(state_root), "SIDECAR_FENCE_WINDOW": "2", "SIDECAR_FENCE_MARGIN": "8"}
    wrapper = agentserver_wrapper(store)
    copy = store.joinpath(*RESILIENT_NAMESPACE) / state_root.name

    def start():
        return start_host(workdir, latest_python, env=env, wrapper=wrapper, app=RESILIENT_APP, ready_timeout=60)

    first = start()
    response_id, _ = start_response(first, stream=False)
    crash_during(first, "two", response_id, state_root, store.joinpath(*RESILIENT_NAMESPACE))

    recreate_compute(state_root)
    second = start()
    assert "fence_wait" in second.log, f"the restarted sidecar should wait out the fence{second.log_tail()}"
    crash_during(second, "four", response_id, state_root, store=None)  # the store is still fenced off
    assert recoverable_stage(copy, response_id) == "two", (
        f"store copy resumes at {recoverable_stage(copy, response_id)!r}; {files_under(store)}{second.log_tail()}"
    )

    recreate_compute(state_root)
    third = start()
    final = poll_until_terminal(third, response_id, STAGE_SECONDS * len(STAGES) + STEP_TIMEOUT)
    assert final["status"] == "completed", f"{final.get('status')}: {final.get('error')}{third.log_tail()}"
    assert output_texts(final) == [ALL_STAGES], final.get("output")
    assert stage_lines(third, "started") == ["two", "three", "four", "five"], third.log_tail()
    assert third.stop(signal.SIGTERM) == 0, third.log_tail()
