"""The Kubernetes topology also runs as plain processes, with the real agent host (issue stack).

Each "pod" is a fresh, empty working directory (the emptyDir volumes) beside a directory store
(the durable store, outside the pod). Its containers become processes, started in kubelet's order:

* ``init-restore`` (deploy/kubernetes/legacy, Container Apps): ``checkpoint-sidecar restore`` runs
  to completion (exit 0), then ``sync`` starts with ``SIDECAR_RESTORE=skip``;
* ``native-sidecar`` (deploy/kubernetes): ``sync`` alone restores, then mirrors;

and in both, ``GET /readyz`` on the sidecar is polled as kubelet's startupProbe would (until 200,
failing if the sidecar exits) before the agent host starts in the same directory. Pod 1 takes the
first turn (the workflow pauses on request_info); the pod is deleted in kubelet's order (agent
first, then the sidecar, which flushes) and its directory wiped; pod 2 comes up the same way and
the continuation completes.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from agenthost import DONE_PREFIX, AgentHost, ensure_venv, free_port
from support import Sidecar, run_cli, sidecar_env

pytestmark = pytest.mark.e2e

PROBE_PERIOD = 0.1  # kubelet's periodSeconds, shortened
STARTUP_DEADLINE = 60.0  # periodSeconds x failureThreshold


@pytest.fixture(scope="module")
def issue_python() -> str:
    return ensure_venv("issue")


def wait_readyz(sidecar: Sidecar, port: int) -> float:
    """Poll /readyz like kubelet's startupProbe; seconds until 200."""
    t0 = time.monotonic()
    url = f"http://127.0.0.1:{port}/readyz"
    while True:
        if sidecar.proc.poll() is not None:
            raise AssertionError(f"sidecar exited {sidecar.proc.returncode} before /readyz answered 200\n{sidecar.log()}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > STARTUP_DEADLINE:
            raise AssertionError(f"startupProbe: {url} not 200 after {STARTUP_DEADLINE}s\n{sidecar.log()}")
        time.sleep(PROBE_PERIOD)


class Pod:
    def __init__(self, workdir: Path, store: Path, python: str, variant: str, logs: Path, n: int):
        self.workdir, self.store, self.python, self.variant = workdir, store, python, variant
        self.logs, self.n = logs, n
        self.sidecar: Sidecar | None = None
        self.agent: AgentHost | None = None
        self.http_port = free_port()

    def start(self) -> "Pod":
        self.workdir.mkdir()
        extra = {"SIDECAR_STORE": str(self.store), "SIDECAR_DRAIN_TIMEOUT": "20"}
        if self.variant == "init-restore":
            # initContainers: restore -- must exit 0 before anything else starts
            r = run_cli("restore", cwd=self.workdir, env=sidecar_env(**extra))
            assert r.returncode == 0, f"restore init step exited {r.returncode}\n{r.stdout}\n{r.stderr}"
            extra["SIDECAR_RESTORE"] = "skip"
        env = sidecar_env(SIDECAR_HTTP_ADDR=f"127.0.0.1:{self.http_port}", **extra)
        self.sidecar = Sidecar(self.workdir, "sync", env=env, log=self.logs / f"pod{self.n}-sidecar.log")
        wait_readyz(self.sidecar, self.http_port)
        # Only now does kubelet start the agent container.
        self.agent = AgentHost(self.workdir, self.python).start().wait_ready(60)
        return self

    def delete(self) -> None:
        """Pod deletion with native-sidecar ordering: the agent stops first, then the sidecar flushes."""
        assert self.agent is not None and self.sidecar is not None
        assert self.agent.stop(signal.SIGTERM) == 0, self.agent.log_tail()
        assert self.sidecar.stop(signal.SIGTERM) == 0, f"sidecar did not flush cleanly\n{self.sidecar.log()}"
        # The emptyDir volumes go with the pod (keep the agent's log for diagnostics first).
        shutil.copy(self.agent.log_path, self.logs / f"pod{self.n}-agent.log")
        shutil.rmtree(self.workdir)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        if self.sidecar is not None and self.sidecar.proc.poll() is None:
            self.sidecar.kill()


@pytest.mark.parametrize("variant", ["init-restore", "native-sidecar"])
def test_pod_recreation_resumes_the_paused_workflow(tmp_path, issue_python, variant):
    store, logs = tmp_path / "store", tmp_path / "logs"
    logs.mkdir()
    workdir = tmp_path / "pod"  # the same path in both pods, like a fixed mount path
    pods: list[Pod] = []
    try:
        first = Pod(workdir, store, issue_python, variant, logs, 1)
        pods.append(first)
        first.start()
        response_id, call_id = first.agent.first_request(user="alice")
        first.delete()
        assert not workdir.exists()
        stored = sorted(p.relative_to(store) for p in store.rglob("*.json"))
        assert any(response_id in str(p) for p in stored), f"store after pod 1: {stored}\n{first.sidecar.log()}"

        second = Pod(workdir, store, issue_python, variant, logs, 2)
        pods.append(second)
        second.start()
        # Rehydrated before the agent started (the agent was started only after /readyz said 200).
        assert list((workdir / ".checkpoints" / "alice" / response_id).glob("*.json")), "checkpoint not restored"
        outcome = second.agent.continue_(response_id, call_id, user="alice")
        assert outcome.status == "completed" and outcome.text == DONE_PREFIX + "approved", (
            f"continuation {outcome}{second.agent.log_tail()}\n{second.sidecar.log()}"
        )
        second.delete()
    finally:
        for pod in pods:
            pod.close()
