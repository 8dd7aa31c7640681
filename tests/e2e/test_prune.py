"""Three sessions of one image on one store, two of which end; ``prune --older-than 0s`` deletes
those two and leaves the live one, which still mirrors, and whose recreated compute resumes its
paused workflow (the real approval agent under ``sidecar run``). ``sessions`` and ``prune`` run in
the live session's environment, ``FOUNDRY_AGENT_SESSION_ID`` included, and still see every session.

On the issue stack and on today's stack (``$AGENTSERVER_STATE_ROOT``), on a directory and on Azure."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from agenthost import wait_for
from tests.e2e.stacks import Stack, StoreView
from tests.e2e.test_points import STACKS_AND_STORES
from tests.e2e.test_recovery import assert_approved
from tests.e2e.test_sessions import Session

pytestmark = pytest.mark.e2e


@STACKS_AND_STORES
def test_prune_takes_the_ended_sessions_and_leaves_the_live_one(tmp_path, stack: Stack, view: StoreView, start_host,
                                                                sidecar_cli):
    view.create()
    live, done1, done2 = (Session(tmp_path, sid, view.url, sidecar_cli, {**view.env, **stack.env})
                          for sid in ("sess-live", "sess-a", "sess-b"))

    def stored(s: Session, r: str, c: str) -> bool:
        files = {k[len(s.prefix):]: v for k, v in view.files(s.prefix).items()}
        return stack.holds_pause(files, r, c)

    hosts = {s.sid: s.start(start_host, stack.python) for s in (live, done1, done2)}
    pauses = {s.sid: hosts[s.sid].first_request() for s in (live, done1, done2)}
    for s in (live, done1, done2):
        r, c = pauses[s.sid]
        wait_for(lambda s=s, r=r, c=c: stored(s, r, c), 20, f"{s.sid}'s pause stored", hosts[s.sid].log_tail)
    for s in (done1, done2):  # their sessions end: a clean exit releases the namespace
        assert hosts[s.sid].stop(signal.SIGTERM) == 0, hosts[s.sid].log_tail()

    # run from the live session's own environment: its FOUNDRY_AGENT_SESSION_ID never narrows them
    env = {**live.env, "SIDECAR_FENCE_MARGIN": "0"}
    listed = subprocess.run([sys.executable, "-m", "sidecar", "sessions", "--json"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    owners = {row["namespace"]: row["owner"] for row in map(json.loads, listed.stdout.splitlines())}
    assert owners == {"approvals/sess-live": "live", "approvals/sess-a": "released", "approvals/sess-b": "released"}

    pruned = subprocess.run([sys.executable, "-m", "sidecar", "prune", "--older-than", "0s", "--force"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert pruned.returncode == 0, pruned.stderr
    assert "pruned 2 namespaces" in pruned.stdout, pruned.stdout
    assert "FOUNDRY_AGENT_SESSION_ID is set and ignored" in pruned.stderr, pruned.stderr
    for s in (done1, done2):
        assert not any(k.startswith(tuple(f"{root}/" for root in stack.roots)) for k in view.files(s.prefix))

    # the live one still mirrors: its workflow completes and a new pause reaches its namespace
    host = hosts[live.sid]
    r, c = pauses[live.sid]
    assert_approved(host.continue_(r, c), host)
    r2, c2 = host.first_request()
    wait_for(lambda: stored(live, r2, c2), 20, "the live session's new pause stored after the prune", host.log_tail)
    assert live.ready()

    # and its recreated compute resumes that paused workflow
    assert host.stop(signal.SIGTERM) == 0, host.log_tail()
    stack.recreate_compute(live.work)
    host = live.start(start_host, stack.python)
    assert_approved(host.continue_(r2, c2), host)
    assert host.stop(signal.SIGTERM) == 0, host.log_tail()
    assert '"event": "fenced"' not in host.log, host.log_tail()
