"""The environments' cache is named by one rule in two languages: ``scripts/lib/env.sh`` (used by
scripts/test, scripts/demo and .ci/run) and ``tests/agenthost.py`` / ``tests/azurite.py`` (used by
the tests). They must agree, or CI would install every agent stack twice."""

from __future__ import annotations

import os
import subprocess

import pytest

from agenthost import REPO_ROOT, STACKS, venv_dir
from tests import azurite


def bash(expr: str, env: dict[str, str]) -> str:
    return subprocess.run(["bash", "-c", f". scripts/lib/env.sh && {expr}"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("where", ["SIDECAR_CACHE", "XDG_CACHE_HOME", "HOME"])
def test_bash_and_python_name_the_same_cached_environments(where, tmp_path, monkeypatch):
    cleared = ("SIDECAR_CACHE", "XDG_CACHE_HOME", *(f"AGENT_VENV_{stack.upper()}" for stack in STACKS))
    env = {k: v for k, v in os.environ.items() if k not in cleared}
    env[where] = str(tmp_path)
    for k in cleared:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(where, str(tmp_path))
    for stack in STACKS:
        assert bash(f"agent_venv {stack}", env) == str(venv_dir(stack))
        assert str(venv_dir(stack)).startswith(str(tmp_path))
    assert bash("echo $AZURITE_VERSION", env) == azurite.AZURITE_VERSION
