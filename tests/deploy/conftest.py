"""Helpers for the deployment-manifest tests (no cluster, no containers, no network)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent.parent
K8S_DIR = REPO / "deploy" / "kubernetes"
ACA_FILE = REPO / "deploy" / "azure-container-apps" / "containerapp.yaml"


def dockerfile_value(path: Path, instruction: str, stage: int = -1) -> str:
    """The argument of the last ``instruction`` (e.g. USER, WORKDIR) in the given stage of a Dockerfile."""
    stages: list[list[tuple[str, str]]] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stages.append([])
        elif stages:
            stages[-1].append((word.upper(), rest.strip()))
    values = [rest for word, rest in stages[stage] if word == instruction.upper()]
    assert values, f"no {instruction} in stage {stage} of {path}"
    return values[-1]


def image_uid() -> int:
    """The numeric UID both images run as (``USER uid:gid`` in their final stages)."""
    uids = set()
    for dockerfile in (REPO / "Dockerfile", REPO / "examples" / "approval_agent" / "Dockerfile"):
        user = dockerfile_value(dockerfile, "USER")
        assert re.fullmatch(r"\d+:\d+", user), f"{dockerfile}: USER {user} is not numeric uid:gid"
        uids.add(int(user.split(":")[0]))
    assert len(uids) == 1, f"the sidecar and agent images run as different UIDs: {uids}"
    return uids.pop()


def agent_workdir() -> str:
    return dockerfile_value(REPO / "examples" / "approval_agent" / "Dockerfile", "WORKDIR")


@pytest.fixture(scope="session")
def kustomize():
    """``render(directory) -> list of documents`` with ``kubectl kustomize`` (or ``kustomize build``)."""
    kubectl, standalone = shutil.which("kubectl"), shutil.which("kustomize")
    if kubectl:
        base = [kubectl, "kustomize"]
    elif standalone:
        base = [standalone, "build"]
    else:
        pytest.skip("neither kubectl nor kustomize is installed")

    def render(directory: Path) -> list[dict]:
        try:
            proc = subprocess.run([*base, str(directory)], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"{' '.join(base)} cannot run here: {e}")
        assert proc.returncode == 0, f"$ {' '.join(base)} {directory}\n{proc.stderr}"
        return [d for d in yaml.safe_load_all(proc.stdout) if d]

    return render


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def port_of(addr: str) -> int:
    return int(addr.rpartition(":")[2])
