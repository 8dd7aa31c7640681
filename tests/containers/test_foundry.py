"""deploy/foundry/Dockerfile: the Foundry hosted-agent image builds and runs as the platform runs it.

The platform's part is played by the environment it injects (``FOUNDRY_AGENT_NAME``,
``FOUNDRY_AGENT_SESSION_ID``, ``PORT=8088``, ``HOME=/home/session``) and by recreating the
container (a new compute of the session: empty roots, the same store, here a directory store on
a Podman volume). The host runs in local mode (no Foundry endpoint offline); the image's working
directory makes its local checkpoint root the hosted one, ``/.checkpoints``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from support import json_lines
from support import wait_for as _wait_for

from .conftest import REPO, _build, run

pytestmark = pytest.mark.containers

TAG = "localhost/approval-agent-foundry:test"
UID = "10001"
HOSTED_ROOTS = ("/.checkpoints", "/.function_approvals", "/home/session/.checkpoints")
GRACE = 30.0  # the grace period the recipe plans for (README.md)


def wait_for(cond, timeout: float, what: str, diagnostics=lambda: ""):
    return _wait_for(cond, timeout, what, lambda: "\n" + diagnostics(), interval=0.2)


@pytest.fixture(scope="module")
def foundry_image(podman: str) -> str:
    return _build(podman, TAG, "deploy/foundry/Dockerfile")


def image_env(podman: str, image: str) -> dict[str, str]:
    (info,) = json.loads(run([podman, "image", "inspect", image]).stdout)
    return dict(e.split("=", 1) for e in info["Config"].get("Env", []))


def test_image_config(podman, foundry_image):
    (info,) = json.loads(run([podman, "image", "inspect", foundry_image]).stdout)
    config = info["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["checkpoint-sidecar", "run", "--"]
    assert config["Cmd"] == ["python", "/app/app.py"]
    assert config["WorkingDir"] == "/", "the host's local-mode root must be the hosted /.checkpoints"
    env = image_env(podman, foundry_image)
    assert env["SIDECAR_ROOTS"] == "/.checkpoints,/.function_approvals"
    assert env["PORT"] == "8088" and env["HOME"] == "/home/session"
    assert not [k for k in env if k.startswith(("FOUNDRY_", "AGENT_"))], "the platform reserves FOUNDRY_* and AGENT_*"
    # The shutdown budget: the host stops before run's SIGKILL, and SIGKILL + flush fit the grace period.
    host = 2 * float(env["AGENTSERVER_GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS"]) + float(env["AGENTSERVER_SHUTDOWN_GRACE_SECONDS"])
    assert host <= float(env["SIDECAR_CHILD_STOP_GRACE"])
    assert float(env["SIDECAR_CHILD_STOP_GRACE"]) + float(env["SIDECAR_DRAIN_TIMEOUT"]) < GRACE


def test_the_image_user_can_write_every_hosted_root(podman, foundry_image):
    script = f"test \"$(id -u):$(id -g)\" = {UID}:{UID} || exit 9; " + "; ".join(
        f"test -w {d} && touch {d}/probe && rm {d}/probe || {{ echo cannot write {d}; exit 1; }}" for d in HOSTED_ROOTS)
    proc = run([podman, "run", "--rm", "--entrypoint", "sh", foundry_image, "-c", script], check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_sidecar_is_pinned_by_constraints(podman, foundry_image):
    """The sidecar's venv holds exactly the versions of constraints.txt (`pip install -c`)."""
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO / "constraints.txt").read_text(), re.MULTILINE))
    script = ("import importlib.metadata as m, json; "
              "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))")
    out = run([podman, "run", "--rm", "--entrypoint", "/opt/checkpoint-sidecar/bin/python", foundry_image, "-c", script])
    installed = json.loads(out.stdout)
    norm = {k.lower().replace("_", "-"): v for k, v in installed.items()}
    checked = {name: (norm.get(name.lower().replace("_", "-")), version) for name, version in pins.items()
               if name.lower().replace("_", "-") in norm}
    assert "azure-storage-blob" in {k.lower() for k in checked}, sorted(norm)
    wrong = {k: v for k, v in checked.items() if v[0] != v[1]}
    assert not wrong, f"installed != constraints.txt: {wrong}"


def http(c, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    """One request to the host from inside its container (the image has python, no curl)."""
    script = (
        "import sys, urllib.request, urllib.error\n"
        "data = sys.argv[3].encode() if sys.argv[3] else None\n"
        "req = urllib.request.Request('http://127.0.0.1:8088' + sys.argv[2], data=data, method=sys.argv[1],"
        " headers={'content-type': 'application/json'})\n"
        "try:\n"
        "    r = urllib.request.urlopen(req, timeout=30); print(r.status); print(r.read().decode())\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code); print(e.read().decode())\n"
        "except OSError as e:\n"
        "    print(0); print(e)\n"
    )
    p = c.exec("python", "-c", script, method, path, json.dumps(body) if body is not None else "", check=False)
    status, _, text = p.stdout.partition("\n")
    return int(status or 0), text


def start_session(container, image: str, volume: str, session: str):
    c = container(image, env={
        "SIDECAR_STORE": "/store", "SIDECAR_PREFIX": "sessions",
        "FOUNDRY_AGENT_NAME": "approval-agent", "FOUNDRY_AGENT_SESSION_ID": session,
        "PORT": "8088", "HOME": "/home/session",
        "AGENT_OBSERVABILITY": "0", "APPLICATIONINSIGHTS_STATSBEAT_DISABLED_ALL": "true",
    }, extra=["-v", f"{volume}:/store:U"])
    wait_for(lambda: http(c, "GET", "/readiness")[0] == 200, 120, f"session {session}'s host to answer /readiness",
             c.logs)
    return c


def events(c, name: str) -> list[dict]:
    return [e for e in json_lines(c.logs()) if e.get("event") == name]


@pytest.fixture
def store_volume(podman: str):
    name = f"csd-foundry-{os.getpid()}"
    run([podman, "volume", "create", name])
    yield name
    subprocess.run([podman, "volume", "rm", "-f", name], capture_output=True, timeout=60)


def test_a_paused_turn_continues_on_a_new_compute_of_its_session(podman, foundry_image, container, store_volume):
    first = start_session(container, foundry_image, store_volume, "s1")
    status, text = http(first, "POST", "/responses", {"input": "ship it"})
    assert status == 200, text
    response = json.loads(text)
    (call,) = [o for o in response["output"] if o["type"] == "function_call"]
    # Mirrored: `status` in the container (its environment: the same store and session) is in sync.
    wait_for(lambda: first.exec("checkpoint-sidecar", "status", check=False).returncode == 0, 60,
             "the paused checkpoint in the store", first.logs)
    run([podman, "stop", "-t", str(int(GRACE)), first.name], timeout=90)
    assert events(first, "shutdown_flushed") or events(first, "final_rescan"), first.logs()

    stored = run([podman, "run", "--rm", "-v", f"{store_volume}:/store", "--entrypoint", "find", foundry_image,
                  "/store", "-name", "*.json", "-path", "*/.checkpoints/*"]).stdout.split()
    # every object in the session's namespace, the checkpoint itself under its root's name
    assert stored and all(p.startswith("/store/sessions/approval-agent/s1/") for p in stored), "\n".join(stored)
    assert any(p.startswith("/store/sessions/approval-agent/s1/.checkpoints/") for p in stored), "\n".join(stored)

    # A new compute of the same session: new container, empty roots, the same store.
    second = start_session(container, foundry_image, store_volume, "s1")
    decisions = {e["root"]: e for e in events(second, "restore_decision")}
    assert decisions["/.checkpoints"]["restore"] is True, second.logs()
    assert "root is empty" in decisions["/.checkpoints"]["reason"], second.logs()
    status, text = http(second, "POST", "/responses", {
        "previous_response_id": response["id"],
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "approved"}]})
    assert status == 200 and "Completed with decision: approved" in text, text + "\n" + second.logs()

    # Another session of the same image and configuration restores nothing of s1's.
    other = start_session(container, foundry_image, store_volume, "s2")
    restored = events(other, "restore_decision")
    assert restored and all(not e["restore"] for e in restored), other.logs()
