"""A stored version no sidecar could have written (``2**63 - 1`` in a record or in blob metadata,
which anyone with write access may set) never freezes its key: it is replaced as if it had no
version, with one warning naming the key. Real ``sync`` processes on both stores."""

from __future__ import annotations

import json

import pytest

from support import disk_tree, wait_for, write_atomic
from tests.integration.fencekit import KINDS, make_target

HOSTILE = 2**63 - 1
NS = {"SIDECAR_PREFIX": "agent/s1"}


@pytest.fixture(params=KINDS)
def target(request, tmp_path):
    yield from make_target(request, tmp_path)


def test_a_key_stored_at_an_impossible_version_is_replaced_with_one_warning(target, tmp_path):
    assert target.put("agent/s1", ".checkpoints/r/a.json", b"frozen", HOSTILE) == HOSTILE
    work = tmp_path / "w"
    work.mkdir()
    sc = target.start(work, "sync", env=target.env(**NS))
    sc.wait_event("ready")
    assert disk_tree(work / ".checkpoints") == {"r/a.json": b"frozen"}  # restored like any other
    for body in (b"the host's", b"the host's next"):
        write_atomic(work / ".checkpoints" / "r" / "a.json", body)
        wait_for(lambda body=body: target.read("agent/s1/.checkpoints/r/a.json") == body, 20, f"{body!r} stored")
    assert sc.stop() == 0
    warned = [e for e in sc.events() if e.get("event") == "stored_version_malformed"]
    assert len(warned) == 1 and warned[0]["key"].endswith(".checkpoints/r/a.json"), warned
    assert not sc.has_event("file_older_than_stored")


def test_an_owner_marker_at_an_impossible_version_is_claimed_over(target, tmp_path):
    marker = json.dumps({"generation": 1, "owner": "x", "heartbeat": 0}).encode()
    assert target.put("agent/s1", ".sidecar/owner", marker, HOSTILE) == HOSTILE
    work = tmp_path / "w"
    (work / ".checkpoints" / "r").mkdir(parents=True)
    sc = target.start(work, "sync", env=target.env(**NS))
    sc.wait_event("ready")
    write_atomic(work / ".checkpoints" / "r" / "b.json", b"mirrored")
    wait_for(lambda: target.read("agent/s1/.checkpoints/r/b.json") == b"mirrored", 20, "stored")
    assert not sc.has_event("fenced")
    assert sc.stop() == 0
    stored = json.loads(target.read("agent/s1/.sidecar/owner") or b"{}")
    assert stored.get("owner") not in (None, "x") and stored["heartbeat"] == 0
