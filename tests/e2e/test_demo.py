"""``scripts/demo`` from a fresh clone: the control fails, the sidecar's restore brings the paused
workflow back, the continuation completes, and the temporary store is gone afterwards.

The clone holds only committed files; the demo reuses this checkout's venvs (``.venv`` linked in,
``AGENT_VENV_ISSUE``), so nothing is installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agenthost import REPO_ROOT, ensure_venv

pytestmark = pytest.mark.e2e


def test_demo_from_a_fresh_clone(tmp_path: Path):
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    venv = Path(sys.prefix)
    if not (venv / "bin" / "checkpoint-sidecar").exists():
        pytest.skip(f"{venv} holds no checkpoint-sidecar to reuse (run the tests from the project venv)")
    agent_python = Path(ensure_venv("issue"))
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SIDECAR_") and k not in ("PYTHONPATH", "DEMO_VENV")}
    (clone / ".venv").symlink_to(venv)  # the default, as on a fresh clone once installed: DEMO_VENV unset
    env.update(AGENT_VENV_ISSUE=str(agent_python.parent.parent))
    proc = subprocess.run([str(clone / "scripts" / "demo")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    assert "installing" not in out, "the demo reinstalled what it was given"
    control, wrapped = out.split("--- 2. under checkpoint-sidecar run -- ---", 1)
    assert "[demo] continuation: failed:" in control and "[sidecar]" not in control, out
    # the sidecar's own text lines at its default level, as an operator sees them
    line = r"^\[sidecar\] \d\d:\d\d:\d\d\.\d{3} info +"
    assert re.search(line + r"store  store=file://\S+/demo namespace=demo$", wrapped, re.M), out
    assert re.search(line + r"shutdown_flushed  .*uploaded=[1-9]", wrapped, re.M), out
    assert re.search(line + r"restore_done  files=[1-9]", wrapped, re.M), out
    assert not re.search(r"^\[sidecar\] \S+ debug ", wrapped, re.M), out
    assert "[demo] continuation: completed: Completed with decision: approved" in wrapped, out
    store = re.search(r"^\[demo\] store: (\S+)/demo ", out, re.M)
    assert store and not Path(store[1]).exists(), f"the temporary store was left behind\n{out}"
