"""A sidecar with no identity never claims a namespace whose marker records one; an operator hands a
namespace over with ``checkpoint-sidecar release`` instead of deleting its marker.

Real ``sync``/``restore``/``release`` processes on both stores.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from support import Sidecar, disk_tree, json_lines, run_cli, wait_for, write_atomic
from tests.integration.fencekit import KINDS, Target, make_target

#: The session's own configuration: its namespace agent/s1 records FOUNDRY_AGENT_SESSION_ID=s1.
SESSION = {"SIDECAR_PREFIX": "agent/{FOUNDRY_AGENT_SESSION_ID}", "FOUNDRY_AGENT_SESSION_ID": "s1"}
#: The finding's sidecar: the same namespace written out, no session id, so no identity.
NO_IDENTITY = {"SIDECAR_PREFIX": "agent/s1"}


@pytest.fixture(params=KINDS)
def target(request, tmp_path):
    yield from make_target(request, tmp_path)


def marker(target: Target, namespace: str) -> dict:
    body = target.read(f"{namespace}/.sidecar/owner")
    assert body is not None
    return json.loads(body)


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.strip().splitlines() if ln and not json_lines(ln)]


def live_session(target: Target, tmp_path: Path) -> tuple[Sidecar, Path]:
    work = tmp_path / "s1"
    work.mkdir()
    sc = target.start(work, "sync", env=target.env(**SESSION, SIDECAR_FENCE_WINDOW="0.5"))  # proves often
    sc.wait_event("ready")
    write_atomic(work / ".checkpoints" / "r" / "private.json", b"s1's own")
    wait_for(lambda: target.read("agent/s1/.checkpoints/r/private.json") == b"s1's own", 20, "s1 stored")
    return sc, work


def test_a_sidecar_without_identity_never_takes_a_sessions_namespace(target, tmp_path):
    owner, _ = live_session(target, tmp_path)
    before = marker(target, "agent/s1")
    assert before["identity"] == {"FOUNDRY_AGENT_SESSION_ID": "s1"}

    intruder = tmp_path / "intruder"
    intruder.mkdir()
    for command in ("restore", "sync"):
        r = run_cli(command, cwd=intruder, env=target.env(**NO_IDENTITY))
        assert r.returncode == 2, (command, r.stderr)
        [line] = error_lines(r.stderr)
        assert line.startswith("checkpoint-sidecar: error: refusing to start: the store namespace 'agent/s1' "
                               "belongs to FOUNDRY_AGENT_SESSION_ID=s1, and this sidecar has no identity"), line
        assert "checkpoint-sidecar release" in line
        assert "Traceback" not in r.stderr
        events = [e.get("event") for e in json_lines(r.stderr)]
        assert "restore_decision" not in events, f"{command} read the namespace before refusing"
    assert disk_tree(intruder / ".checkpoints") == {}  # nothing restored
    assert marker(target, "agent/s1") == before  # never claimed: the owner is not fenced

    # the hint, pasted as printed (in an environment naming another store and session): it names
    # the store and the namespace, and release refuses the live owner, which goes on mirroring
    hint = line.split("hand the namespace over to any identity: ", 1)[1].split(". Reading it", 1)[0]
    words = shlex.split(hint)
    assigned = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    assert words[len(assigned):] == ["checkpoint-sidecar", "release"], hint
    assert assigned["SIDECAR_STORE"] == target.url and assigned["SIDECAR_PREFIX"] == "agent/s1", hint
    pasted = run_cli("release", cwd=intruder, env={**target.env(SIDECAR_PREFIX="elsewhere", FOUNDRY_AGENT_SESSION_ID="s9",
                                                                SIDECAR_STORE=str(tmp_path / "default-store")),
                                                   **assigned})
    assert pasted.returncode == 2 and "its owner is live" in pasted.stderr, pasted.stderr
    assert marker(target, "agent/s1") == before
    write_atomic(tmp_path / "s1" / ".checkpoints" / "r" / "private.json", b"s1 goes on")
    wait_for(lambda: target.read("agent/s1/.checkpoints/r/private.json") == b"s1 goes on", 20, "s1 still mirrored")
    assert not owner.has_event("fenced")
    assert owner.stop() == 0


def test_release_hands_a_namespace_over(target, tmp_path):
    owner, _ = live_session(target, tmp_path)
    assert owner.stop() == 0  # the session ended cleanly: the marker is released, identity kept

    r = run_cli("release", cwd=tmp_path, env=target.env(**NO_IDENTITY))
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(
        "checkpoint-sidecar: released the namespace 'agent/s1' in "), out
    assert "(owned by FOUNDRY_AGENT_SESSION_ID=s1): a sidecar of any identity may claim it now" in out[0]
    m = marker(target, "agent/s1")
    assert "identity" not in m and m["heartbeat"] == 0  # released before: no write window to wait out

    # the sidecar without identity now takes it over, restores, and mirrors without waiting
    new = tmp_path / "new"
    new.mkdir()
    sc = target.start(new, "sync", env=target.env(**NO_IDENTITY))
    sc.wait_event("ready")
    assert disk_tree(new / ".checkpoints") == {"r/private.json": b"s1's own"}
    write_atomic(new / ".checkpoints" / "r" / "private.json", b"the new owner's")
    wait_for(lambda: target.read("agent/s1/.checkpoints/r/private.json") == b"the new owner's", 20, "stored")
    assert not sc.has_event("fence_wait")
    assert sc.stop() == 0
    assert "identity" not in marker(target, "agent/s1")

    r = run_cli("release", cwd=tmp_path, env=target.env(SIDECAR_PREFIX="agent/nobody"))
    assert r.returncode == 0, r.stderr
    assert "nothing to release" in r.stdout
    assert target.read("agent/nobody/.sidecar/owner") is None  # nothing created


def test_release_under_a_running_owner_fences_it(target, tmp_path):
    owner, work = live_session(target, tmp_path)
    before = marker(target, "agent/s1")
    refused = run_cli("release", cwd=tmp_path, env=target.env(**NO_IDENTITY))  # live: refused without --force
    assert refused.returncode == 2, refused.stderr
    [line] = error_lines(refused.stderr)
    assert "its owner is live: FOUNDRY_AGENT_SESSION_ID=s1 holds it" in line and "--force" in line, line
    assert marker(target, "agent/s1") == before
    r = run_cli("release", "--force", cwd=tmp_path, env=target.env(**NO_IDENTITY))
    assert r.returncode == 0, r.stderr
    assert "if that sidecar still runs it is fenced at its next write" in r.stdout
    assert marker(target, "agent/s1")["heartbeat"] != 0  # the next claim waits out the owner's window
    # the owner's next proof of ownership (within one write window of its last) fails
    writes = iter(range(10_000))

    def write_and_look() -> bool:
        write_atomic(work / ".checkpoints" / "r" / f"late-{next(writes)}.json", b"after the release")
        return owner.has_event("fenced")

    wait_for(write_and_look, 30, "the owner fenced", interval=0.2)
    write_atomic(work / ".checkpoints" / "r" / "after-fenced.json", b"never stored")
    assert owner.stop() == 75
    assert target.read("agent/s1/.checkpoints/r/after-fenced.json") is None


def test_release_after_a_rolled_back_marker_still_fences_the_running_owner(target, tmp_path):
    """The marker alone does not order a release: a marker restored from an old backup says
    generation 1 while the running owner holds a higher one (above the versions stored). The
    release's stamp goes above every stored version, so the owner is fenced at its next proof and
    never overwrites the handed-over marker."""
    # the namespace already holds a version of generation 5: the owner claims above it
    assert target.put("agent/s1", ".checkpoints/r/old.json", b"old", 5 << 40 | 1) == 5 << 40 | 1
    owner, work = live_session(target, tmp_path)
    held = marker(target, "agent/s1")["generation"] >> 32
    assert held > 5
    # an operator restores the marker from an old backup: generation 1, the owner's identity
    target.delete("agent/s1/.sidecar/owner")
    old = json.dumps({"generation": 1 << 32 | 7, "owner": "old", "heartbeat": 1.0,
                      "identity": {"FOUNDRY_AGENT_SESSION_ID": "s1"}}).encode()
    assert target.put("agent/s1", ".sidecar/owner", old, 1 << 32 | 7) == 1 << 32 | 7

    r = run_cli("release", "--force", cwd=tmp_path, env=target.env(**NO_IDENTITY))
    assert r.returncode == 0, r.stderr
    released = marker(target, "agent/s1")
    assert released["generation"] >> 32 > held, (released, held)
    writes = iter(range(10_000))

    def write_and_look() -> bool:
        write_atomic(work / ".checkpoints" / "r" / f"late-{next(writes)}.json", b"after the release")
        return owner.has_event("fenced")

    wait_for(write_and_look, 30, "the owner fenced", interval=0.2)
    assert owner.stop() == 75
    assert marker(target, "agent/s1") == released  # the owner never overwrote the handed-over marker
