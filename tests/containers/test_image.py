"""The sidecar image (./Dockerfile): builds, runs as its non-root user, answers --help, stops on SIGTERM.

Its size (total and above the base image) is printed in the "container images" summary section.
"""

from __future__ import annotations

import json

import pytest

from support import json_lines
from support import wait_for as _wait_for

from .conftest import BASE_IMAGE, SIZES, run

pytestmark = pytest.mark.containers

UID = "10001"
POLL = 0.2


def wait_for(cond, timeout: float, what: str, diagnostics=lambda: ""):
    return _wait_for(cond, timeout, what, lambda: "\n" + diagnostics(), interval=POLL)


events = json_lines  # the JSON log lines of a container's output


def test_image_config(podman, sidecar_image):
    (image,) = json.loads(run([podman, "image", "inspect", sidecar_image]).stdout)
    config = image["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["checkpoint-sidecar"]
    assert config["Cmd"] == ["sync"]
    assert config["WorkingDir"] == "/app"
    assert config.get("StopSignal") in ("SIGTERM", "15", None)
    assert "7479/tcp" in (config.get("ExposedPorts") or {})
    health = image.get("Healthcheck") or config.get("Healthcheck") or {}  # podman | docker
    assert health.get("Test", [])[:3] == ["CMD", "checkpoint-sidecar", "probe"], health
    env = dict(e.split("=", 1) for e in config.get("Env", []))
    assert env.get("SIDECAR_HTTP_ADDR") == "0.0.0.0:7479"


def test_runs_as_non_root_and_answers_help(podman, sidecar_image):
    help_ = run([podman, "run", "--rm", "--no-healthcheck", sidecar_image, "--help"])
    assert "usage: checkpoint-sidecar" in help_.stdout
    for command in ("restore", "sync", "run", "status", "probe"):
        assert command in help_.stdout
    ids = run([podman, "run", "--rm", "--no-healthcheck", "--entrypoint", "id", sidecar_image]).stdout
    assert f"uid={UID}(" in ids and f"gid={UID}(" in ids, ids


def test_final_stage_has_no_build_tools(podman, sidecar_image):
    script = (
        "for t in gcc cc make; do command -v $t && exit 1; done; "
        "ls /opt/checkpoint-sidecar/bin/pip* 2>/dev/null && exit 1; "
        "test -w /app/.checkpoints && test -w /app/.function_approvals"
    )
    proc = run([podman, "run", "--rm", "--no-healthcheck", "--entrypoint", "sh", sidecar_image, "-c", script],
               check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_report_image_size(podman, sidecar_image):
    """Not a limit (the lead records the number): the size of the image and of what it adds."""
    (tag, total, added), = [s for s in SIZES if s[0] == sidecar_image]
    print(f"\n{tag}: {total / 1e6:.1f} MB total, {added / 1e6:.1f} MB above {BASE_IMAGE}")
    assert 0 < added < total


def test_sync_serves_probes_and_stops_cleanly_on_sigterm(podman, sidecar_image, container):
    """PID 1 is the CLI: SIGTERM from `podman stop` reaches it, it flushes and exits 0 quickly."""
    c = container(sidecar_image, env={"SIDECAR_STORE": "/home/sidecar/store", "SIDECAR_DRAIN_TIMEOUT": "20"})
    wait_for(lambda: any(e.get("event") == "ready" for e in events(c.logs())), 60, "the 'ready' log event", c.logs)
    # What HEALTHCHECK and exec probes run; /readyz and /livez over the container's own address.
    assert c.exec("checkpoint-sidecar", "probe", "live", check=False).returncode == 0, c.logs()
    assert c.exec("checkpoint-sidecar", "probe", "ready", check=False).returncode == 0, c.logs()
    assert c.inspect("{{.State.Pid}}") != "0"
    assert c.exec("cat", "/proc/1/cmdline").stdout.split("\0")[1:3] == ["/opt/checkpoint-sidecar/bin/checkpoint-sidecar", "sync"]

    c.exec("sh", "-c", "mkdir -p /app/.checkpoints/resp_1 && echo '{\"x\": 1}' > /app/.checkpoints/resp_1/a.json")
    run([podman, "stop", "-t", "30", c.name], timeout=60)
    # 0, not 137: SIGTERM was handled (an unhandled one ends in SIGKILL after the 30 s)
    assert c.inspect("{{.State.ExitCode}}") == "0", c.logs()
    stored = run([podman, "cp", f"{c.name}:/home/sidecar/store/.checkpoints/resp_1/a.json", "-"]).stdout
    assert "a.json" in stored  # `podman cp ... -` writes a tar stream that names the file
