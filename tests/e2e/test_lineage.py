"""A new compute's disk is not the truth: files an image ships never cost a session its state.

The real approval agent runs under ``sidecar run`` and pauses on ``request_info``; the compute is
then recreated from an "image" whose ``.checkpoints/`` is not empty:

* a stray file (a ``COPY . /app`` of a developer tree): the sidecar must not take the disk for
  the truth, nor make the store match it (which deleted every stored checkpoint of the session);
* an older copy of the session's own paused checkpoint: the stored version replaces it (named in
  a warning), and its bytes never reach the store.

Either way the continuation completes, and the store still holds every checkpoint it held. Both
stores (the ``view`` fixture): a directory and Azure Blob Storage (Azurite, the real SDK).
"""

from __future__ import annotations

import json
import signal

import pytest

from agenthost import wait_for
from support import json_lines
from tests.e2e.test_recovery import assert_approved, paused_checkpoint, recreate_compute

pytestmark = pytest.mark.e2e

USER = "alice"
STRAY = ".checkpoints/caresp_dev/0000.json"  # what a developer's tree leaves in the image


def _events(host, name: str) -> list[dict]:
    return [e for e in json_lines(host.log) if e.get("event") == name]


@pytest.mark.parametrize("image", ["stray_file", "older_copy"])
def test_a_recreated_compute_whose_image_holds_files_resumes_and_loses_nothing(
    workdir, issue_python, start_host, sidecar_cli, view, image
):
    import sys

    wrapper = [sys.executable, "-m", "sidecar", "run", "--http-addr", "", "--store", view.url, "--"]
    env = {**sidecar_cli, **view.env, "SIDECAR_LOG_FORMAT": "json"}
    first = start_host(workdir, issue_python, wrapper=wrapper, env=env, ready_timeout=60)
    response_id, call_id = first.first_request(user=USER)
    assert first.stop(signal.SIGTERM) == 0, first.log_tail()
    paused = paused_checkpoint(workdir / ".checkpoints", response_id, call_id, USER)
    assert paused is not None, first.log_tail()
    paused_key = str(paused.relative_to(workdir))
    before = view.stored()
    assert paused_key in before, (paused_key, before)

    # The compute is recreated from an image whose .checkpoints/ is not empty.
    paused_state = json.loads(paused.read_bytes())
    recreate_compute(workdir)
    if image == "stray_file":
        planted = workdir / STRAY
        planted.parent.mkdir(parents=True)
        planted.write_text('{"from": "the developer tree the image was built from"}')
    else:  # the same checkpoint as it was before the workflow paused: nothing pending
        planted = workdir / paused_key
        planted.parent.mkdir(parents=True)
        planted.write_text(json.dumps({**paused_state, "pending_request_info_events": {}}))

    second = start_host(workdir, issue_python, wrapper=wrapper, env=env, ready_timeout=60)
    start = wait_for(lambda: _events(second, "reconcile_start"), 30, "the first reconcile", second.log_tail)[0]
    outcome = second.continue_(response_id, call_id, user=USER)
    stored = view.stored()
    assert start["delete"] == 0, f"the first reconcile deletes stored checkpoints: {start}{second.log_tail()}"
    assert before.items() <= stored.items(), f"stored checkpoints lost or overwritten: {before} -> {stored}"
    assert_approved(outcome, second)
    decision = next(e for e in _events(second, "restore_decision") if e["root"].endswith(".checkpoints"))
    assert decision["restore"] is True and "merging" in decision["reason"], decision
    if image == "older_copy":
        replaced = [e["path"] for e in _events(second, "restore_replaced_local")]
        assert replaced == [paused_key], second.log_tail()
    assert second.stop(signal.SIGTERM) == 0, second.log_tail()
    if image == "stray_file":  # a local file the store lacked: mirrored as usual
        assert STRAY in view.stored()
