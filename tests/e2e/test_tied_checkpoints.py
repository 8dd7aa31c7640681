"""Checkpoints whose timestamps tie: the host picks the same "latest" after a restore as before.

Core 1.26.0 (today's stack) picks among the checkpoints with the newest timestamp by lineage: one
named by another's ``previous_checkpoint_id`` is superseded, then the greatest id wins. Its pick
depends on the whole set of files, so a restore must bring back every checkpoint of a context, not
only the newest. Three checkpoints of one chain (tests/e2e/tied_checkpoints.py, written and read
by core's ``FileCheckpointStorage`` in today's venv) are mirrored by ``sidecar run``, the compute is
recreated and ``sidecar restore`` brings them back: the pick is the one made before the loss.

The ``drops_one`` variant proves the check bites: a restore that loses the middle checkpoint of the
chain (deleted after the restore) makes the host resume the chain's root instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.stacks import Stack, StoreView, disk_files

pytestmark = pytest.mark.e2e

HELPER = str(Path(__file__).with_name("tied_checkpoints.py"))
CONTEXT = ".checkpoints/caresp_tied"


def run(*args: str, cwd: Path, env: dict[str, str]) -> str:
    r = subprocess.run(args, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{args} exited {r.returncode}: {r.stderr[-2000:]}"
    return r.stdout


@pytest.mark.parametrize(
    "stack,view,restore",
    [
        ("today", "directory", "whole"),
        pytest.param("today", "azure", "whole", marks=pytest.mark.azure),
        ("today", "directory", "drops_one"),
    ],
    indirect=["stack", "view"],
)
def test_a_restore_keeps_the_hosts_pick_among_tied_checkpoints(workdir, stack: Stack, view: StoreView, sidecar_cli,
                                                                restore):
    env = {**sidecar_cli, **view.env}
    sidecar = [sys.executable, "-m", "sidecar"]
    run(*sidecar, "run", "--http-addr", "", "--store", view.url, "--", stack.python, HELPER, "write", CONTEXT,
        cwd=workdir, env=env)
    files = disk_files(workdir, (CONTEXT,))
    tied = {json.loads(v).get("timestamp") for v in files.values()}
    assert len(files) == 3 and len(tied) == 1, (tied, sorted(files))
    before = run(stack.python, HELPER, "latest", CONTEXT, cwd=workdir, env={}).strip()
    assert before == "a-leaf"

    stack.recreate_compute(workdir)
    run(*sidecar, "restore", "--store", view.url, cwd=workdir, env=env)
    if restore == "drops_one":
        (workdir / CONTEXT / "b-middle.json").unlink()
    after = run(stack.python, HELPER, "latest", CONTEXT, cwd=workdir, env={}).strip()
    if restore == "whole":
        assert after == before, f"the host resumes {after} after the restore, {before} before the loss"
    else:
        assert after != before, "a restore that drops one checkpoint of a tied set went unnoticed"
