"""A paused workflow survives compute recreation only with the sidecar.

The sample approval agent (examples/approval_agent/app.py) pauses on ``request_info``; the test
then restarts the host and continues the workflow with a ``function_call_output``.

* control (issue stack, no sidecar): restarting with the state directories intact resumes the
  workflow; deleting ``.checkpoints`` / ``.function_approvals`` first (what recreating the compute
  does) makes the continuation fail.
* sidecar: the host runs under ``python -m sidecar run --store <dir> --``; after a SIGTERM (or a
  SIGKILL of wrapper and host) and the same deletion, the restarted wrapper restores the state
  and the continuation completes.
* latest stack: the same app resumes from ``$AGENTSERVER_STATE_ROOT`` and fails without it.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from agenthost import DONE_PREFIX, wait_for
from tests.e2e.stacks import store_file_name

pytestmark = pytest.mark.e2e

WORKFLOW_NAME = "approval-workflow"
APPROVED = DONE_PREFIX + "approved"
STATE_DIRS = (".checkpoints", ".function_approvals")

stream_modes = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
users = pytest.mark.parametrize("user", [None, "alice"], ids=["anonymous", "alice"])


def recreate_compute(workdir: Path) -> None:
    """What a new session compute sees: none of the host's local state directories."""
    for name in STATE_DIRS:
        shutil.rmtree(workdir / name, ignore_errors=True)
        assert not (workdir / name).exists()


def paused_checkpoint(root: Path, response_id: str, call_id: str, user: str | None) -> Path | None:
    """The checkpoint file under ``root/[user/]<response_id>/`` that holds the pending ``call_id``."""
    directory = root / user / response_id if user else root / response_id
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now; the next poll sees the new file
        if call_id in (data.get("pending_request_info_events") or {}):
            return path
    return None


def assert_local_layout(workdir: Path, response_id: str, call_id: str, user: str | None) -> None:
    """The issue-stack host's on-disk state after the first turn (what the sidecar mirrors)."""
    checkpoints = workdir / ".checkpoints"
    found = paused_checkpoint(checkpoints, response_id, call_id, user)
    assert found is not None, f"no checkpoint holding {call_id} in {sorted(checkpoints.rglob('*'))}"
    # One checkpoint per turn directory survives the host's pruning, named after the workflow.
    assert [p.name for p in found.parent.iterdir()] == [found.name]
    data = json.loads(found.read_text())
    assert data["workflow_name"] == WORKFLOW_NAME
    assert data["checkpoint_id"] == found.stem
    # Locally the host keeps function approvals in memory: nothing is written.
    assert not (workdir / ".function_approvals").exists()


def assert_approved(outcome, host) -> None:
    assert outcome.status == "completed" and outcome.text == APPROVED, f"continuation {outcome}{host.log_tail()}"


# ---------------------------------------------------------------------------------------------
# control: the bare host on the issue stack
# ---------------------------------------------------------------------------------------------


@stream_modes
@users
def test_restart_with_state_intact_resumes(workdir, issue_python, start_host, stream, user):
    """Sanity: the named workflow resumes from disk in a new process."""
    first = start_host(workdir, issue_python)
    response_id, call_id = first.first_request(user=user, stream=stream)
    assert_local_layout(workdir, response_id, call_id, user)
    assert first.stop() == 0

    second = start_host(workdir, issue_python)
    assert_approved(second.continue_(response_id, call_id, user=user, stream=stream), second)
    assert second.stop() == 0


@stream_modes
@users
def test_control_compute_recreation_loses_the_paused_workflow(workdir, issue_python, start_host, stream, user):
    """Without the sidecar, deleting the state directories makes the continuation fail."""
    first = start_host(workdir, issue_python)
    response_id, call_id = first.first_request(user=user, stream=stream)
    assert first.stop() == 0

    recreate_compute(workdir)
    second = start_host(workdir, issue_python)
    outcome = second.continue_(response_id, call_id, user=user, stream=stream)
    assert outcome.text != APPROVED, f"continuation unexpectedly resumed: {outcome}"
    assert outcome.status == "failed", f"continuation {outcome}{second.log_tail()}"
    assert second.stop() == 0


# ---------------------------------------------------------------------------------------------
# sidecar: python -m sidecar run --store <dir> -- <host>
# ---------------------------------------------------------------------------------------------


@stream_modes
@users
def test_sidecar_restores_after_sigterm_and_compute_recreation(
    workdir, tmp_path, issue_python, start_host, sidecar_wrapper, stream, user
):
    store = tmp_path / "store"
    wrapper, env = sidecar_wrapper(store)

    first = start_host(workdir, issue_python, wrapper=wrapper, env=env, ready_timeout=60)
    response_id, call_id = first.first_request(user=user, stream=stream)
    # SIGTERM goes to the wrapper: it forwards it, flushes, and exits with the host's code.
    assert first.stop(signal.SIGTERM) == 0, first.log_tail()
    assert paused_checkpoint(store / ".checkpoints", response_id, call_id, user) is not None, (
        f"after a graceful stop the store must hold the paused checkpoint; store has "
        f"{sorted(str(p.relative_to(store)) for p in store.rglob('*') if p.is_file())}{first.log_tail()}"
    )

    recreate_compute(workdir)
    second = start_host(workdir, issue_python, wrapper=wrapper, env=env, ready_timeout=60)
    assert_approved(second.continue_(response_id, call_id, user=user, stream=stream), second)
    assert second.stop(signal.SIGTERM) == 0, second.log_tail()


def test_sidecar_restores_after_sigkill_and_compute_recreation(
    workdir, tmp_path, issue_python, start_host, sidecar_wrapper
):
    """Wrapper and host die without warning once the store holds the paused checkpoint."""
    user, stream = "alice", False
    store = tmp_path / "store"
    wrapper, env = sidecar_wrapper(store)

    first = start_host(workdir, issue_python, wrapper=wrapper, env=env, ready_timeout=60)
    response_id, call_id = first.first_request(user=user, stream=stream)
    wait_for(
        lambda: paused_checkpoint(store / ".checkpoints", response_id, call_id, user),
        20.0,
        f"the store to hold the checkpoint pending {call_id}",
        first.log_tail,
    )
    first.kill()  # SIGKILL to the process group: no forwarding, no final flush

    recreate_compute(workdir)
    second = start_host(workdir, issue_python, wrapper=wrapper, env=env, ready_timeout=60)
    assert_approved(second.continue_(response_id, call_id, user=user, stream=stream), second)
    assert second.stop(signal.SIGTERM) == 0, second.log_tail()


@pytest.mark.azure
@stream_modes
@users
def test_sidecar_restores_from_azure_blob_storage(
    workdir, issue_python, start_host, sidecar_wrapper, azurite, stream, user
):
    """The same recovery with the store in Azure Blob Storage (Azurite, the real async SDK)."""
    from tests.azurite import unique_container

    wrapper, env = sidecar_wrapper(azurite.container_url(unique_container("e2e")))
    env = {**env, **azurite.env()}
    first = start_host(workdir, issue_python, wrapper=wrapper, env=env, ready_timeout=60)
    response_id, call_id = first.first_request(user=user, stream=stream)
    assert first.stop(signal.SIGTERM) == 0, first.log_tail()

    recreate_compute(workdir)
    second = start_host(workdir, issue_python, wrapper=wrapper, env=env, ready_timeout=60)
    assert paused_checkpoint(workdir / ".checkpoints", response_id, call_id, user) is not None, second.log_tail()
    assert_approved(second.continue_(response_id, call_id, user=user, stream=stream), second)
    assert second.stop(signal.SIGTERM) == 0, second.log_tail()


# ---------------------------------------------------------------------------------------------
# latest stack: the same app, state under $AGENTSERVER_STATE_ROOT
# ---------------------------------------------------------------------------------------------


def _store_file(state_root: Path, store_name: str) -> Path:
    return state_root / "state_stores" / store_file_name(store_name)


@stream_modes
def test_latest_stack_needs_only_state_stores_to_resume(workdir, latest_python, start_host, stream):
    state_root = workdir / ".agentserver"
    env = {"AGENTSERVER_STATE_ROOT": str(state_root)}
    first = start_host(workdir, latest_python, env=env)
    response_id, call_id = first.first_request(user="alice", stream=stream)
    assert first.stop() == 0

    store_file = _store_file(state_root, f"checkpoints/{response_id}")
    items = json.loads(store_file.read_text())["items"]
    assert any(
        call_id in (item["value"].get("pending_request_info_events") or {})
        and item["value"]["workflow_name"] == WORKFLOW_NAME
        for item in items.values()
    ), f"{store_file} does not hold the paused checkpoint"
    assert not any((workdir / name).exists() for name in STATE_DIRS), "the latest stack writes no local state dirs"

    # Recreated compute without state_stores/ (responses/ kept): the continuation fails.
    saved = workdir / "state_stores.saved"
    shutil.move(state_root / "state_stores", saved)
    second = start_host(workdir, latest_python, env=env)
    outcome = second.continue_(response_id, call_id, user="alice", stream=stream)
    assert outcome.status == "failed" and outcome.text != APPROVED, f"continuation {outcome}"
    assert "Cannot find an existing workflow checkpoint" in json.dumps(outcome.error), str(outcome)
    assert second.stop() == 0

    # Putting state_stores/ back (what a restore does) is enough for the same continuation to resume.
    shutil.rmtree(state_root / "state_stores", ignore_errors=True)
    shutil.move(saved, state_root / "state_stores")
    third = start_host(workdir, latest_python, env=env)
    assert_approved(third.continue_(response_id, call_id, user="alice", stream=stream), third)
    assert third.stop() == 0
