"""Fixtures for the container suite (marker ``containers``): Podman, the images, podman-compose.

* ``podman``: the podman executable; skips when Podman is missing or cannot run containers, or when
  the base image is not present locally (the tests never pull: build it or pull it beforehand).
* ``sidecar_image`` / ``agent_image``: ``podman build`` of ./Dockerfile and
  examples/approval_agent/Dockerfile, once per session (layer cache makes rebuilds cheap).
* ``podman_compose``: a podman-compose that honours ``depends_on`` conditions (>= 1.3):
  ``$PODMAN_COMPOSE``, else the one on PATH when recent enough, else a pinned one installed with
  pip into ``.cache/podman-compose`` (once, under a file lock).

Image sizes and build times are printed in a "container images" section at the end of the run.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
BASE_IMAGE = "docker.io/library/python:3.11-slim-bookworm"
AZURITE_IMAGE = "mcr.microsoft.com/azure-storage/azurite"
SIDECAR_TAG = "localhost/checkpoint-sidecar:test"
AGENT_TAG = "localhost/approval-agent:test"
PODMAN_COMPOSE_PIN = "1.6.0"
BUILD_TIMEOUT = 900.0

#: (what, seconds) and (image, total bytes, bytes above the base image) for the summary.
TIMINGS: list[tuple[str, float]] = []
SIZES: list[tuple[str, int, int]] = []


def run(cmd: list[str], timeout: float = 120.0, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"$ {' '.join(cmd)}\nexit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n"
            f"--- stderr ---\n{proc.stderr[-4000:]}"
        )
    return proc


def image_size(podman: str, image: str) -> int:
    return int(run([podman, "image", "inspect", "--format", "{{.Size}}", image]).stdout.strip())


@pytest.fixture(scope="session")
def podman() -> str:
    exe = shutil.which("podman")
    if not exe:
        pytest.skip("podman is not installed: the container tests need Podman (see deploy/compose/README.md)")
    try:
        info = subprocess.run([exe, "info", "--format", "{{.Host.OCIRuntime.Name}}"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"podman cannot run here: {e}")
    if info.returncode != 0:
        pytest.skip(f"podman cannot run here: {info.stderr.strip()[-500:]}")
    if subprocess.run([exe, "image", "exists", BASE_IMAGE], timeout=60).returncode != 0:
        pytest.skip(f"base image {BASE_IMAGE} is not present locally and the tests never pull; "
                    f"pull it (or build a local stand-in) first")
    return exe


def _build(podman: str, tag: str, dockerfile: str) -> str:
    t0 = time.monotonic()
    # --format docker keeps HEALTHCHECK (the OCI format has no field for it); --pull=never: the
    # base image is local (checked by the podman fixture), the tests do not reach image registries.
    run([podman, "build", "--format", "docker", "--pull=never", "-t", tag, "-f", str(REPO / dockerfile), str(REPO)],
        timeout=BUILD_TIMEOUT)
    seconds = time.monotonic() - t0
    TIMINGS.append((f"podman build {dockerfile}", seconds))
    total = image_size(podman, tag)
    SIZES.append((tag, total, total - image_size(podman, BASE_IMAGE)))
    return tag


@pytest.fixture(scope="session")
def sidecar_image(podman: str) -> str:
    return _build(podman, SIDECAR_TAG, "Dockerfile")


@pytest.fixture(scope="session")
def agent_image(podman: str) -> str:
    return _build(podman, AGENT_TAG, "examples/approval_agent/Dockerfile")


@pytest.fixture(scope="session")
def azurite_image(podman: str) -> str:
    if subprocess.run([podman, "image", "exists", AZURITE_IMAGE], timeout=60).returncode != 0:
        pytest.skip(f"{AZURITE_IMAGE} is not present locally and the tests never pull; pull it first")
    return AZURITE_IMAGE


def _compose_version(exe: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"^podman-compose\S* version\s+(\d+(?:\.\d+)*)", out, re.MULTILINE)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


@pytest.fixture(scope="session")
def podman_compose(podman: str) -> str:
    """A podman-compose >= 1.3 (Debian 12 ships 1.0.3, which ignores depends_on conditions)."""
    explicit = os.environ.get("PODMAN_COMPOSE")
    if explicit:
        return explicit
    found = shutil.which("podman-compose")
    if found and (_compose_version(found) or (0,)) >= (1, 3):
        return found
    venv = REPO / ".cache" / "podman-compose"
    exe = venv / "bin" / "podman-compose"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / ".podman-compose.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _compose_version(str(exe)) != tuple(int(x) for x in PODMAN_COMPOSE_PIN.split(".")):
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
            proc = subprocess.run(
                [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                 f"podman-compose=={PODMAN_COMPOSE_PIN}"],
                capture_output=True, text=True, timeout=300,
            )
            if proc.returncode != 0:
                shutil.rmtree(venv, ignore_errors=True)
                pytest.skip(f"could not install podman-compose=={PODMAN_COMPOSE_PIN}: {proc.stderr[-1000:]}")
    return str(exe)


@dataclass
class Container:
    """A detached container started by a test; removed at teardown."""

    podman: str
    name: str

    def logs(self) -> str:
        p = run([self.podman, "logs", self.name], check=False)
        return p.stdout + p.stderr

    def inspect(self, fmt: str) -> str:
        return run([self.podman, "inspect", "--format", fmt, self.name]).stdout.strip()

    def exec(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return run([self.podman, "exec", self.name, *cmd], check=check)


@pytest.fixture
def container(podman: str):
    """``start(image, *args, env=..., name=...) -> Container`` (``podman run -d``); all removed at teardown."""
    started: list[str] = []

    def start(image: str, *args: str, env: dict[str, str] | None = None, extra: list[str] | None = None) -> Container:
        name = f"csd-test-{os.getpid()}-{len(started)}"
        cmd = [podman, "run", "-d", "--name", name, "--no-healthcheck"]
        for k, v in (env or {}).items():
            cmd += ["-e", f"{k}={v}"]
        run([*cmd, *(extra or []), image, *args])
        started.append(name)
        return Container(podman, name)

    yield start
    for name in started:
        subprocess.run([podman, "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not (SIZES or TIMINGS):
        return
    terminalreporter.section("container images")
    for tag, total, added in SIZES:
        terminalreporter.write_line(
            f"{tag:40} {total / 1e6:7.1f} MB total, {added / 1e6:6.1f} MB above {BASE_IMAGE}"
        )
    for what, seconds in TIMINGS:
        terminalreporter.write_line(f"{what:60} {seconds:6.1f}s")
