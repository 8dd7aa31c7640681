"""Versions never depend on the owner marker alone: a claim's generation is above every version
already stored in the namespace. A deleted (or rolled-back) marker, or objects copied in from
another namespace, never leave a new compute's writes "older than stored".

Real ``sync`` processes on both stores (a directory, and Azurite through the real store), one
working directory per compute, as in tests/integration/test_namespaces.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from support import Sidecar, write_atomic
from tests.integration.fencekit import KINDS, Target, make_target

KEY = ".checkpoints/approval_requests.json"


@pytest.fixture(params=KINDS)
def target(request, tmp_path):
    yield from make_target(request, tmp_path)


def compute_writes(target: Target, work: Path, data: bytes, **env: str) -> Sidecar:
    """A compute's life: sync (restoring what is stored), the host rewrites KEY, a clean stop."""
    work.mkdir()
    sc = target.start(work, "sync", env=target.env(**env))
    sc.wait_event("ready")
    write_atomic(work / KEY, data)
    assert sc.stop() == 0, sc.log()[-3000:]
    return sc


def refused(sc: Sidecar) -> list[dict]:
    return [e for e in sc.events() if e.get("event") == "file_older_than_stored"]


@pytest.mark.slow  # waits the fence window out; the rule runs in process (tests/store/test_takeover.py)
def test_writes_land_after_the_owner_marker_is_deleted(target, tmp_path):
    """The finding: four computes write gen1..gen4, the marker is deleted (an operator freeing the
    namespace), then each of computes 5, 6 and 7 writes: each write must be stored."""
    for n in range(1, 5):
        compute_writes(target, tmp_path / f"c{n}", f"gen{n}".encode(), SIDECAR_PREFIX="agent")
        assert target.read(f"agent/{KEY}") == f"gen{n}".encode()
    target.delete("agent/.sidecar/owner")
    for n in range(5, 8):
        sc = compute_writes(target, tmp_path / f"c{n}", f"gen{n}".encode(), SIDECAR_PREFIX="agent")
        assert not refused(sc), refused(sc)
        assert target.read(f"agent/{KEY}") == f"gen{n}".encode(), f"compute {n}'s write was not stored"
    assert not any(e.get("event") == "fence_generation_lifted" for e in sc.events()), \
        "only the first claim after the loss lifts the generation: the marker is right again"


def test_a_rolled_back_marker_does_not_freeze_a_key(target, tmp_path):
    """The marker restored from an old backup (generation 1) while the objects are of generation 3."""
    compute_writes(target, tmp_path / "c1", b"one", SIDECAR_PREFIX="agent")
    old_marker = target.read("agent/.sidecar/owner")
    assert old_marker is not None
    for n in (2, 3):
        compute_writes(target, tmp_path / f"c{n}", f"gen{n}".encode(), SIDECAR_PREFIX="agent")
    # roll the marker back: delete it and put generation 1's body back with its own version
    target.delete("agent/.sidecar/owner")
    _put_marker(target, "agent", old_marker)
    sc = compute_writes(target, tmp_path / "c4", b"gen4", SIDECAR_PREFIX="agent")
    assert not refused(sc), refused(sc)
    assert target.read(f"agent/{KEY}") == b"gen4"


def test_a_server_side_copy_of_a_namespace_can_be_written_to(target, tmp_path):
    for n in (1, 2, 3):  # namespace a: its objects carry generation 3's versions
        compute_writes(target, tmp_path / f"a{n}", f"a{n}".encode(), SIDECAR_PREFIX="a")
    compute_writes(target, tmp_path / "b1", b"b1", SIDECAR_PREFIX="b")  # b's marker: generation 1
    target.copy_namespace("a", "b")
    assert target.read(f"b/{KEY}") == b"a3"
    sc = compute_writes(target, tmp_path / "b2", b"written in b", SIDECAR_PREFIX="b")
    assert not refused(sc), refused(sc)
    assert target.read(f"b/{KEY}") == b"written in b"
    assert target.read(f"a/{KEY}") == b"a3"  # the source is untouched


def _put_marker(target: Target, namespace: str, body: bytes) -> None:
    """Put an owner marker back as a sidecar stores it (version = its stamp)."""
    from sidecar.marker import OWNER_KEY
    from sidecar.store.base import ObjectMeta

    stamp = json.loads(body)["generation"]
    store = target.store(namespace)

    async def put() -> None:
        await store.open()
        try:
            await store.put(OWNER_KEY, body, ObjectMeta.of(body, stamp, 0o600, version=stamp))
        finally:
            await store.aclose()

    anyio.run(put)
