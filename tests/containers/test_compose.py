"""deploy/compose for real: play.sh runs the recovery story under podman-compose.

Azurite, restore (init step), sidecar (sync) and the sample agent as containers; the paused
workflow's checkpoint goes to Azurite, the state volumes are removed (compute recreation, Azurite's
volume kept), the stack comes back and the continuation completes. The images are the session's
test builds (SIDECAR_IMAGE / AGENT_IMAGE), so compose builds nothing; the project name and the
agent's host port are unique to this run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from .conftest import REPO, TIMINGS

pytestmark = pytest.mark.containers

COMPOSE_DIR = REPO / "deploy" / "compose"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_compose_demo_plays_the_recovery_story(podman, podman_compose, sidecar_image, agent_image, azurite_image,
                                                tmp_path):
    project = f"csd-test-{os.getpid()}"
    env = {
        **os.environ,
        "COMPOSE": podman_compose,
        "ENGINE": podman,
        "COMPOSE_PROJECT_NAME": project,
        "AGENT_PORT": str(free_port()),
        "SIDECAR_IMAGE": sidecar_image,
        "AGENT_IMAGE": agent_image,
        "PLAY_TIMEOUT": "120",
    }
    log = tmp_path / "play.log"
    t0 = time.monotonic()
    try:
        with open(log, "w") as out:
            proc = subprocess.run(["bash", str(COMPOSE_DIR / "play.sh")], cwd=COMPOSE_DIR, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=600)
    finally:
        # play.sh removes its stack itself; this covers a timeout or an interrupted run.
        subprocess.run([podman_compose, "-p", project, "-f", "compose.yaml", "down", "-v", "-t", "5"], cwd=COMPOSE_DIR,
                       env=env, capture_output=True, timeout=300)
    seconds = time.monotonic() - t0
    TIMINGS.append(("deploy/compose/play.sh (the whole story)", seconds))
    output = log.read_text(errors="replace")
    assert proc.returncode == 0, f"play.sh exited {proc.returncode}\n{output[-8000:]}"
    assert 'the paused workflow survived compute recreation: "Completed with decision: approved"' in output, output
    # The gate held both times: restore finished before the agent started.
    assert output.count("restore exited 0 at") == 2, output
    # The second restore brought the checkpoint back from Azurite.
    assert '"restore": true' in output and "root is empty: filling it from the store" in output, output
    leftovers = subprocess.run([podman, "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={project}"],
                               capture_output=True, text=True, timeout=60).stdout.split()
    assert not leftovers, f"containers of {project} left behind: {leftovers}"
