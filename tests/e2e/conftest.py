"""Fixtures for the end-to-end suite: the real agent host, optionally behind the sidecar.

* ``issue_python`` / ``latest_python``: the python of the pinned agent venvs (built on first use).
* ``stack`` / ``view``: the agent stack (default "issue") and the store (default: a directory; or
  Azure on Azurite) a test runs on, both parametrizable with ``indirect=True`` (tests/e2e/stacks.py).
* ``workdir``: an empty working directory for the host (its ``.checkpoints`` lands here).
* ``start_host``: starts an :class:`~agenthost.AgentHost` and waits until it is ready; every host
  is killed (process group) at teardown, whatever the test did.
* ``sidecar_wrapper``: ``store -> [python, -m, sidecar, run, --store, store, --]``; skips the test
  when ``python -m sidecar run --help`` does not work (CLI not there yet / broken).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import agenthost  # noqa: E402
from agenthost import REPO_ROOT, AgentHost, ensure_venv  # noqa: E402
from tests.e2e.stacks import Stack, StoreView  # noqa: E402


@pytest.fixture(scope="session")
def issue_python() -> str:
    return ensure_venv("issue")


@pytest.fixture(scope="session")
def latest_python() -> str:
    return ensure_venv("latest")


@pytest.fixture
def stack(request) -> Stack:
    name = getattr(request, "param", "issue")
    return Stack(name, ensure_venv(name))


@pytest.fixture(params=["directory", pytest.param("azure", marks=pytest.mark.azure)])
def view(request, tmp_path) -> StoreView:
    if request.param == "directory":
        return StoreView("directory", str(tmp_path / "store"), {})
    from tests.azurite import unique_container

    azurite = request.getfixturevalue("azurite")
    return StoreView("azure", azurite.container_url(unique_container("e2e")), azurite.env())


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.fixture
def start_host():
    hosts: list[AgentHost] = []

    def start(cwd, python, *, env=None, wrapper=None, ready_timeout: float = 30.0, **kwargs) -> AgentHost:
        host = AgentHost(cwd, python, env=env, wrapper=wrapper, **kwargs)
        hosts.append(host)
        return host.start().wait_ready(ready_timeout)

    yield start
    for host in hosts:
        host.close()


def _sidecar_env() -> dict[str, str]:
    """The wrapper imports ``sidecar`` from this checkout even when it is not installed."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else ""), "SIDECAR_FENCE_MARGIN": "1"}


@pytest.fixture(scope="session")
def sidecar_cli() -> dict[str, str]:
    """Env for running ``python -m sidecar``; skips when ``sidecar run --help`` fails."""
    env = {**os.environ, **_sidecar_env()}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "sidecar", "run", "--help"],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"sidecar CLI unavailable: `python -m sidecar run --help` could not run: {exc}")
    if proc.returncode != 0:
        detail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
        pytest.skip(
            f"sidecar CLI unavailable: `python -m sidecar run --help` exited {proc.returncode}: {detail[0]}"
        )
    return _sidecar_env()


@pytest.fixture
def sidecar_wrapper(sidecar_cli):
    """``store -> (wrapper command, env)`` for running the host under ``sidecar run``."""

    def make(store: Path) -> tuple[list[str], dict[str, str]]:
        return [sys.executable, "-m", "sidecar", "run", "--http-addr", "", "--store", str(store), "--"], dict(sidecar_cli)

    return make


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not agenthost.TIMINGS:
        return
    groups: dict[tuple[str, str], list[float]] = {}
    for what, label, seconds in agenthost.TIMINGS:
        groups.setdefault((label, what), []).append(seconds)
    terminalreporter.section("agent host timings")
    for (label, what), values in sorted(groups.items()):
        values.sort()
        terminalreporter.write_line(
            f"{label:24} {what:22} n={len(values):3}  median={values[len(values) // 2]:.2f}s  max={values[-1]:.2f}s"
        )
