"""Two live sessions of one image and one configuration on one store, as Foundry runs them.

Each session is a compute of its own (a working directory) told apart only by
``FOUNDRY_AGENT_SESSION_ID``; both hosts run the real approval agent under ``sidecar run`` with the
same ``SIDECAR_STORE``. Both pause on ``request_info``; session one finishes its workflow and
pauses a new one; each compute is then recreated in turn and each continuation completes. Neither
disk ever holds the other session's files, and both sidecars stay ready (never fenced).
"""

from __future__ import annotations

import signal
import sys
import urllib.request
from pathlib import Path

import pytest

from agenthost import free_port, wait_for
from tests.e2e.test_recovery import assert_approved, paused_checkpoint, recreate_compute

pytestmark = pytest.mark.e2e

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Session:
    """One session's compute: its working directory, its wrapper's health port, its host."""

    def __init__(self, tmp_path: Path, sid: str, store: Path | str, sidecar_cli: dict[str, str],
                 env: dict[str, str] | None = None) -> None:
        """``store``: a directory or a store URL; ``env``: added to the wrapper's (credentials, layout)."""
        self.sid = sid
        self.work = tmp_path / sid
        self.work.mkdir()
        self.health = free_port()
        self.wrapper = [sys.executable, "-m", "sidecar", "run", "--http-addr", f"127.0.0.1:{self.health}", "--"]
        self.env = {**sidecar_cli, "SIDECAR_STORE": str(store), "SIDECAR_LOG_FORMAT": "json",
                    "FOUNDRY_AGENT_NAME": "approvals", "FOUNDRY_AGENT_SESSION_ID": sid, **(env or {})}
        self.prefix = f"approvals/{sid}/"  # its namespace in the store
        self.namespace = Path(store) / "approvals" / sid  # the same, for a directory store
        self.host = None

    def start(self, start_host, python: str):
        self.host = start_host(self.work, python, wrapper=self.wrapper, env=self.env, ready_timeout=60)
        wait_for(self.ready, 20, f"{self.sid}'s sidecar ready", self.host.log_tail)
        return self.host

    def ready(self) -> bool:
        try:
            with _DIRECT.open(f"http://127.0.0.1:{self.health}/readyz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def response_dirs(self) -> set[str]:
        root = self.work / ".checkpoints"
        return {p.name for p in root.iterdir() if p.is_dir()} if root.exists() else set()


def test_two_sessions_of_one_configuration_recover_their_own_workflows(tmp_path, issue_python, start_host, sidecar_cli):
    store = tmp_path / "store"
    store.mkdir()  # a mounted volume: where the platform names sessions a missing store is refused
    one, two = (Session(tmp_path, sid, store, sidecar_cli) for sid in ("sess-one", "sess-two"))
    host1, host2 = one.start(start_host, issue_python), two.start(start_host, issue_python)

    r1, c1 = host1.first_request()
    r2, c2 = host2.first_request()
    seen = {one.sid: {r1}, two.sid: {r2}}

    def apart() -> None:
        """Neither disk holds a response directory of the other session; both sidecars ready."""
        assert not one.response_dirs() & seen[two.sid], (one.response_dirs(), seen)
        assert not two.response_dirs() & seen[one.sid], (two.response_dirs(), seen)
        assert one.ready() and two.ready()

    apart()
    # session one finishes its workflow and pauses a new one
    assert_approved(host1.continue_(r1, c1), host1)
    r1b, c1b = host1.first_request()
    seen[one.sid].add(r1b)
    wait_for(lambda: paused_checkpoint(one.namespace / ".checkpoints", r1b, c1b, None), 20,
             "session one's new pause stored in its namespace", host1.log_tail)
    wait_for(lambda: paused_checkpoint(two.namespace / ".checkpoints", r2, c2, None), 20,
             "session two's pause stored in its namespace", host2.log_tail)
    apart()

    # session one's compute is recreated: its continuation completes, session two is untouched
    assert host1.stop(signal.SIGTERM) == 0, host1.log_tail()
    recreate_compute(one.work)
    host1 = one.start(start_host, issue_python)
    apart()
    assert_approved(host1.continue_(r1b, c1b), host1)

    # then session two's
    assert host2.stop(signal.SIGTERM) == 0, host2.log_tail()
    recreate_compute(two.work)
    host2 = two.start(start_host, issue_python)
    apart()
    assert_approved(host2.continue_(r2, c2), host2)

    for host in (host1, host2):
        assert host.stop(signal.SIGTERM) == 0, host.log_tail()
        assert '"event": "fenced"' not in host.log, host.log_tail()
    assert not (store / ".checkpoints").exists()  # nothing at the shared top of the store
