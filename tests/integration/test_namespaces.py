"""Many computes on one store: each session in its own namespace, an identity guard, upgrades.

Real ``sync``/``restore`` processes on both stores (a directory, and Azurite through the real
store). Each compute is a working directory of its own with the same configuration; only the
platform's variables tell them apart, as on Foundry (``FOUNDRY_AGENT_SESSION_ID``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import Sidecar, disk_tree, json_lines, run_cli, sidecar_env, wait_for, write_atomic


class Target:
    """One store of the parametrized kind, and what it holds."""

    def __init__(self, kind: str, tmp_path: Path, request) -> None:
        self.kind = kind
        self.azure = None
        if kind == "azure":
            from tests.faults.faultkit import new_target

            self.azure = new_target(request.getfixturevalue("azurite"), "ns")
            self.url = self.azure.store_url
        else:
            self.dir = tmp_path / "store"
            self.dir.mkdir()  # a mounted volume: on a platform a missing directory store is refused
            self.url = str(self.dir)

    def env(self, **extra: str) -> dict[str, str]:
        base = self.azure.env(**extra) if self.azure else sidecar_env(**extra)
        base["SIDECAR_STORE"] = self.url
        return base

    def names(self) -> set[str]:
        """Every data object's name in the store (the sidecar's own metadata files left out)."""
        if self.azure:
            return set(self.azure.all_blobs(with_data=False))
        return {str(p.relative_to(self.dir)) for p in self.dir.rglob("*")
                if p.is_file() and ".sidecar-meta" not in p.parts}

    def marker(self, namespace: str) -> dict:
        key = f"{namespace}/.sidecar/owner" if namespace else ".sidecar/owner"
        if self.azure:
            return json.loads(self.azure.all_blobs()[key][1])
        return json.loads((self.dir / key).read_bytes())

    def close(self) -> None:
        if self.azure:
            self.azure.drop()


@pytest.fixture(params=["directory", pytest.param("azure", marks=pytest.mark.azure)])
def target(request, tmp_path):
    t = Target(request.param, tmp_path, request)
    yield t
    t.close()


def session(sid: str, agent: str = "approvals", **extra: str) -> dict[str, str]:
    return {"FOUNDRY_AGENT_NAME": agent, "FOUNDRY_AGENT_SESSION_ID": sid, **extra}


def compute(tmp_path: Path, name: str) -> Path:
    w = tmp_path / name
    w.mkdir()
    return w


def mirror_once(target: Target, work: Path, files: dict[str, bytes], **env: str) -> None:
    """A compute's life: sync, the host writes ``files``, everything is stored, a clean stop."""
    sc = Sidecar(work, "sync", env=target.env(**env))
    sc.wait_event("ready")
    for rel, data in files.items():
        write_atomic(work / rel, data)
    assert sc.stop() == 0, sc.log()[-2000:]  # 0: the drain stored everything


def error_lines(stderr: str) -> list[str]:
    """What the operator reads: the lines that are not JSON log events."""
    return [ln for ln in stderr.strip().splitlines() if ln and not json_lines(ln)]


def test_two_live_sessions_keep_their_own_state(target, tmp_path):
    a, b = compute(tmp_path, "a"), compute(tmp_path, "b")
    sa = Sidecar(a, "sync", env=target.env(**session("s1")))
    sa.wait_event("ready")
    write_atomic(a / ".checkpoints" / "r1" / "one.json", b"session one")
    wait_for(lambda: "approvals/s1/.checkpoints/r1/one.json" in target.names(), 20, "s1 stored")

    sb = Sidecar(b, "sync", env=target.env(**session("s2")))  # same image, same configuration
    sb.wait_event("ready")
    assert disk_tree(b / ".checkpoints") == {}  # nothing of session one's
    write_atomic(b / ".checkpoints" / "r2" / "two.json", b"session two")
    write_atomic(a / ".checkpoints" / "r1" / "one-more.json", b"still mirrored")
    wait_for(lambda: {"approvals/s2/.checkpoints/r2/two.json", "approvals/s1/.checkpoints/r1/one-more.json"}
             <= target.names(), 20, "both sessions stored")
    assert not sa.has_event("fenced") and not sb.has_event("fenced")
    assert sa.stop() == 0 and sb.stop() == 0
    assert sa.wait_event("store")["namespace"] == "approvals/s1 (FOUNDRY_AGENT_SESSION_ID=s1)"

    # each session's compute is recreated: each gets back exactly its own files
    for sid, files in (("s1", {"r1/one.json": b"session one", "r1/one-more.json": b"still mirrored"}),
                       ("s2", {"r2/two.json": b"session two"})):
        fresh = compute(tmp_path, f"fresh-{sid}")
        r = run_cli("restore", cwd=fresh, env=target.env(**session(sid)))
        assert r.returncode == 0, r.stderr
        assert disk_tree(fresh / ".checkpoints") == files
    assert target.marker("approvals/s1")["identity"] == {"FOUNDRY_AGENT_SESSION_ID": "s1"}


def test_a_template_naming_only_the_agent_keeps_each_session_apart(target, tmp_path):
    """``SIDECAR_PREFIX=agents/{FOUNDRY_AGENT_NAME}`` where the platform names sessions: one
    namespace and one identity for every session, so session two restored session one's private
    file and fenced it while session one's host went on, unmirrored. Each session is its own."""
    agent_only = {"SIDECAR_PREFIX": "agents/{FOUNDRY_AGENT_NAME}"}
    a, b = compute(tmp_path, "a"), compute(tmp_path, "b")
    sa = Sidecar(a, "sync", env=target.env(**session("s1", **agent_only)))
    sa.wait_event("ready")
    write_atomic(a / ".checkpoints" / "r1" / "private.json", b"session one's")
    wait_for(lambda: "agents/approvals/s1/.checkpoints/r1/private.json" in target.names(), 20, "s1 stored")

    sb = Sidecar(b, "sync", env=target.env(**session("s2", **agent_only)))
    sb.wait_event("ready")
    assert disk_tree(b / ".checkpoints") == {}  # nothing of session one's
    write_atomic(a / ".checkpoints" / "r1" / "later.json", b"still mirrored")
    wait_for(lambda: "agents/approvals/s1/.checkpoints/r1/later.json" in target.names(), 20, "s1 still stored")
    assert not sa.has_event("fenced") and not sb.has_event("fenced")
    assert sa.stop() == 0 and sb.stop() == 0
    assert sb.wait_event("store")["namespace"] == ("agents/approvals/s2 (FOUNDRY_AGENT_NAME=approvals, "
                                                   "FOUNDRY_AGENT_SESSION_ID=s2)")
    assert target.marker("agents/approvals/s1")["identity"] == {"FOUNDRY_AGENT_NAME": "approvals",
                                                                 "FOUNDRY_AGENT_SESSION_ID": "s1"}


def test_another_identity_is_refused_before_it_restores(target, tmp_path):
    shared = {"SIDECAR_PREFIX": "shared", "SIDECAR_SESSION_NAMESPACE": "off"}
    mirror_once(target, compute(tmp_path, "a"), {".checkpoints/r/x.json": b"s1's"}, **session("s1", **shared))

    other = compute(tmp_path, "b")
    r = run_cli("restore", cwd=other, env=target.env(**session("s2", **shared)))
    assert r.returncode == 2, r.stderr
    [line] = error_lines(r.stderr)
    assert line.startswith("checkpoint-sidecar: error: refusing to start: the store namespace 'shared' belongs to "
                           "FOUNDRY_AGENT_SESSION_ID=s1, and this sidecar is FOUNDRY_AGENT_SESSION_ID=s2"), line
    assert "Traceback" not in r.stderr
    assert disk_tree(other / ".checkpoints") == {}
    sc = Sidecar(other, "sync", env=target.env(**session("s2", **shared)))  # sync is refused the same way
    assert sc.proc.wait(30) == 2
    assert target.marker("shared")["identity"] == {"FOUNDRY_AGENT_SESSION_ID": "s1"}  # never fenced

    successor = compute(tmp_path, "a2")  # the same session's recreated compute takes over
    r = run_cli("restore", cwd=successor, env=target.env(**session("s1", **shared)))
    assert r.returncode == 0, r.stderr
    assert disk_tree(successor / ".checkpoints") == {"r/x.json": b"s1's"}


def test_a_fixed_prefix_without_identity_is_shared_as_before(target, tmp_path):
    mirror_once(target, compute(tmp_path, "a"), {".checkpoints/r/x.json": b"v1"}, SIDECAR_PREFIX="app")
    assert "identity" not in target.marker("app")
    b = compute(tmp_path, "b")  # a single-replica Deployment's next pod: every sidecar is a successor
    r = run_cli("restore", cwd=b, env=target.env(SIDECAR_PREFIX="app"))
    assert r.returncode == 0, r.stderr
    assert disk_tree(b / ".checkpoints") == {"r/x.json": b"v1"}


def test_an_unnamed_marker_is_taken_over_by_the_session(target, tmp_path):
    # written by a release that recorded no identity, at the place this session now uses
    mirror_once(target, compute(tmp_path, "old"), {".checkpoints/r/x.json": b"kept"},
                SIDECAR_PREFIX="approvals/s1")
    assert "identity" not in target.marker("approvals/s1")
    new = compute(tmp_path, "new")
    sc = Sidecar(new, "sync", env=target.env(**session("s1")))
    sc.wait_event("fence_claimed")
    assert disk_tree(new / ".checkpoints") == {"r/x.json": b"kept"}
    assert sc.stop() == 0
    assert target.marker("approvals/s1")["identity"] == {"FOUNDRY_AGENT_SESSION_ID": "s1"}


def test_a_store_written_before_namespaces_is_found_and_adopted(target, tmp_path):
    mirror_once(target, compute(tmp_path, "old"), {".checkpoints/r/x.json": b"before the upgrade"})
    assert ".checkpoints/r/x.json" in target.names()

    new = compute(tmp_path, "new")
    r = run_cli("restore", cwd=new, env=target.env(**session("s1")))
    assert r.returncode == 0, r.stderr
    assert disk_tree(new / ".checkpoints") == {}  # never restored from outside the namespace unasked
    [found] = [e for e in json_lines(r.stderr) if e.get("event") == "legacy_state_found"]
    assert found["roots"] == ".checkpoints" and found["namespace"] == "approvals/s1"
    assert "SIDECAR_PREFIX='' SIDECAR_SESSION_NAMESPACE=off checkpoint-sidecar restore" in found["detail"]

    # the documented way: restore from the old place once, then sync mirrors it into the namespace
    r = run_cli("restore", cwd=new, env=target.env(**session("s1", SIDECAR_PREFIX="", SIDECAR_SESSION_NAMESPACE="off")))
    assert r.returncode == 0, r.stderr
    assert disk_tree(new / ".checkpoints") == {"r/x.json": b"before the upgrade"}
    assert "rm .checkpoints/.sidecar-lineage" in found["detail"]
    # the record names the old place: a root another namespace recorded is refused (exit 2) until it goes
    r = run_cli("restore", cwd=new, env=target.env(**session("s1")))
    assert r.returncode == 2 and "refusing to start" in r.stderr, r.stderr
    (new / ".checkpoints" / ".sidecar-lineage").unlink()
    sc = Sidecar(new, "sync", env=target.env(**session("s1")))
    wait_for(lambda: "approvals/s1/.checkpoints/r/x.json" in target.names(), 20, "adopted into the namespace")
    assert sc.stop() == 0
    assert not any(e.get("event") == "legacy_state_found" for e in sc.events())


def test_a_prefix_template_gives_each_replica_its_own_namespace(target, tmp_path):
    for pod in ("web-0", "web-1"):
        mirror_once(target, compute(tmp_path, pod), {f".checkpoints/{pod}.json": pod.encode()},
                    SIDECAR_PREFIX="pods/{POD_NAME}", POD_NAME=pod)
    assert {"pods/web-0/.checkpoints/web-0.json", "pods/web-1/.checkpoints/web-1.json"} <= target.names()
    fresh = compute(tmp_path, "fresh")
    r = run_cli("restore", cwd=fresh, env=target.env(SIDECAR_PREFIX="pods/{POD_NAME}", POD_NAME="web-1"))
    assert r.returncode == 0, r.stderr
    assert disk_tree(fresh / ".checkpoints") == {"web-1.json": b"web-1"}
    r = run_cli("restore", cwd=fresh, env=target.env(SIDECAR_PREFIX="pods/{POD_NAME}"))
    assert r.returncode == 2 and error_lines(r.stderr) == [
        "checkpoint-sidecar: config error: SIDECAR_PREFIX: refers to {POD_NAME}, which is unset or empty: "
        "set it, or remove the reference"]
