"""An owner marker that cannot be read (deeply nested JSON, hundreds of MB, not an object) is
read bounded and parsed defensively: ``restore``, ``sync`` and ``run`` refuse the namespace with
one line naming the marker's key and the fix (exit 2), never a traceback and never a take-over;
``release`` rewrites it, and the namespace is claimed again. Real processes on both stores."""

from __future__ import annotations

import contextlib
import json
import os
import sys

import pytest

from support import json_lines, run_cli, wait_for, write_atomic
from tests.integration.fencekit import KINDS, Target, make_target

NS = {"SIDECAR_PREFIX": "agent/s1"}
KEY = "agent/s1/.sidecar/owner"
#: Runs the command and prints its peak RSS (KiB) as the last line of stderr.
PEAK_RSS = (sys.executable, "-c", "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")


@pytest.fixture(params=KINDS)
def target(request, tmp_path):
    yield from make_target(request, tmp_path)


def plant(target: Target, body: bytes) -> None:
    """What someone with write access to the store does."""
    if target.azure:
        import anyio
        from azure.core.exceptions import ResourceExistsError

        async def upload(c) -> None:
            with contextlib.suppress(ResourceExistsError):
                await c.create_container()
            await c.upload_blob(KEY, body, overwrite=True)

        anyio.run(target._azure, upload)
    else:
        path = target.dir / KEY
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.strip().splitlines() if ln and not json_lines(ln)]


def assert_refused(target: Target, work, body: bytes) -> None:
    for args in (("restore",), ("sync",), ("run", "--", "true")):
        r = run_cli(*args, cwd=work, env=target.env(**NS))
        assert r.returncode == 2, (args, r.returncode, r.stderr[-2000:])
        [line] = error_lines(r.stderr)
        assert line.startswith("checkpoint-sidecar: error: refusing to start: the owner marker "
                               f"'{KEY}' of the store namespace 'agent/s1' cannot be read ("), line
        assert "checkpoint-sidecar release" in line and "Traceback" not in r.stderr and "Error" not in line
        assert target.read(KEY) == body  # never taken over


@pytest.mark.parametrize("body", [
    pytest.param(b"garbage{", id="garbage"),
    # the same path through the refusal, release and claim: in the full run only
    pytest.param(b"[" * 200_000, id="nested-200k", marks=pytest.mark.slow),
    pytest.param(b"[" * 60_000, id="nested-60k", marks=pytest.mark.slow),
    pytest.param(b"[1, 2]", id="list", marks=pytest.mark.slow),
    pytest.param(b"", id="empty", marks=pytest.mark.slow),
])
def test_an_unreadable_marker_is_refused_then_released(target, tmp_path, body):
    work = tmp_path / "w"
    (work / ".checkpoints").mkdir(parents=True)
    write_atomic(work / ".checkpoints" / "a.json", b"mine")
    plant(target, body)
    assert_refused(target, work, body)

    # written moments ago: it may be a live sidecar's, so release asks for --force (its own line says so)
    r = run_cli("release", cwd=work, env=target.env(**NS))
    assert r.returncode == 2 and "its marker cannot be read" in r.stderr and "release --force" in r.stderr, r.stderr
    r = run_cli("release", "--force", cwd=work, env=target.env(**NS))
    assert r.returncode == 0, r.stderr
    assert "released the namespace 'agent/s1'" in r.stdout
    assert json.loads(target.read(KEY) or b"")["owner"] == "released"
    sc = target.start(work, "sync", env=target.env(**NS))
    sc.wait_event("ready")
    wait_for(lambda: target.read("agent/s1/.checkpoints/a.json") == b"mine", 30, "mirrored after the release")
    assert sc.stop() == 0


def test_a_huge_marker_is_never_read_whole(tmp_path, request):
    """A 300 MB marker (sparse: no disk) was read whole: release reached 654 MB RSS."""
    target = Target("directory", tmp_path, request)
    work = tmp_path / "w"
    work.mkdir()
    path = target.dir / KEY
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.write(b"{")
        f.truncate(300 * 1024 * 1024)
    for args in (("restore",), ("release", "--force")):
        r = run_cli(*args, cwd=work, env=target.env(**NS), wrap=PEAK_RSS)
        peak_kib = int(r.stderr.strip().splitlines()[-1])
        assert peak_kib < 150 * 1024, (args, peak_kib)
        assert r.returncode == (2 if args == ("restore",) else 0), r.stderr[-2000:]
    assert os.path.getsize(path) < 1024  # released: rewritten
