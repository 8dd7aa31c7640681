"""The fence's arithmetic and its claim against a real directory store: a claim's generation is
above every version stored, whatever the marker says; a hand-over frees the namespace."""

from __future__ import annotations

import json

import anyio
import pytest

from sidecar.fence import MAX_FLOOR_GENERATION, VERSION_COUNTER_BITS, Fence
from sidecar.marker import OWNER_KEY, counted_version, floor_stamp, next_stamp, read_marker
from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore
from sidecar.takeover import hand_over


def version(generation: int, write: int) -> int:
    return generation << VERSION_COUNTER_BITS | write


@pytest.mark.parametrize("generation", [0, 1, 4, 1000, MAX_FLOOR_GENERATION])
def test_a_claim_above_the_floor_writes_versions_above_it(generation):
    floor = version(generation, 2**VERSION_COUNTER_BITS - 1)  # the last write that generation can make
    stamp = next_stamp(floor_stamp(floor))
    assert stamp >> 32 == generation + 1
    assert version(stamp >> 32, 1) > floor


def test_a_version_no_sidecar_writes_does_not_count():
    assert counted_version(version(MAX_FLOOR_GENERATION + 1, 1)) == 0
    assert counted_version(2**63 - 1) == 0 and counted_version(-1) == 0
    assert floor_stamp(2**63 - 1) == 0
    assert counted_version(version(7, 3)) == version(7, 3)


def put(store, key: str, data: bytes, ver: int) -> None:
    anyio.run(lambda: store.put(key, data, ObjectMeta.of(data, 1, 0o600, version=ver)))


@pytest.fixture
def store(tmp_path):
    s = DirectoryStore(str(tmp_path / "store"), "ns")
    anyio.run(s.open)
    yield s
    anyio.run(s.aclose)


@pytest.mark.parametrize("floor_known", [True, False])
def test_a_claim_without_a_marker_goes_above_the_stored_versions(store, floor_known):
    put(store, ".checkpoints/a.json", b"gen4", version(4, 9))

    async def claim() -> Fence:
        fence = Fence(store, floor=version(4, 9) if floor_known else None)  # None: the claim lists
        await fence.claim()
        return fence

    fence = anyio.run(claim)
    assert fence.generation == 5
    assert fence.next_version() > version(4, 9)


def test_a_claim_goes_above_a_rolled_back_marker_and_the_floor(store):
    stamp = next_stamp(0)  # generation 1
    body = json.dumps({"generation": stamp, "owner": "old", "heartbeat": 0}).encode()
    put(store, OWNER_KEY, body, stamp)
    fence = Fence(store, floor=version(3, 1))
    anyio.run(fence.claim)
    assert fence.generation == 4


def test_hand_over(store):
    assert anyio.run(hand_over, store) is None  # no marker: nothing to free, nothing written
    assert anyio.run(read_marker, store) == {}

    fence = Fence(store, identity={"FOUNDRY_AGENT_SESSION_ID": "s1"})
    anyio.run(fence.claim)  # the owner, running (its heartbeat is not 0)
    done = anyio.run(hand_over, store)
    assert done is not None and done.identity == {"FOUNDRY_AGENT_SESSION_ID": "s1"} and done.held
    marker = anyio.run(read_marker, store)
    assert "identity" not in marker and marker["heartbeat"] != 0 and done.generation == fence.generation + 1

    async def proof() -> str | None:  # the owner's next proof fails: it is fenced
        fence.valid_until = 0
        try:
            await fence.before_write()
        except Exception as e:
            return str(e)
        return None

    assert "owns this store prefix" in (anyio.run(proof) or "")

    async def successor() -> Fence:  # of another identity: may claim it now
        f = Fence(store, identity={"FOUNDRY_AGENT_SESSION_ID": "s2"}, margin=0, window=0.01)
        await f.claim()
        return f

    assert anyio.run(successor).generation == done.generation + 1


@pytest.mark.parametrize("handed_over", [False, True])
def test_a_take_over_waits_the_predecessors_recorded_window_when_longer(store, handed_over):
    """A predecessor trusts each proof for its own write window: a successor whose window is
    shorter waits out the one the marker records (outside tester, round 2: the old owner's
    deletes landed after the new one's take-over check). A hand-over's marker carries it on."""
    old = Fence(store, window=30.0, margin=8.0)
    anyio.run(old.claim)  # running: its heartbeat is not 0
    if handed_over:  # `release --force` of a live owner
        assert anyio.run(hand_over, store).held
    now = [1000.0]
    new = Fence(store, window=2.0, margin=8.0, clock=lambda: now[0])
    anyio.run(new.claim)
    assert new.writable_at == 1000.0 + 30.0 + 8.0
    shorter = Fence(store, window=60.0, margin=8.0, clock=lambda: now[0])  # ours longer: ours
    anyio.run(shorter.claim)
    assert shorter.writable_at == 1000.0 + 60.0 + 8.0


def test_a_longer_window_is_recorded_on_by_the_claim_that_waited_it(store):
    """B waited out A's longer window, then died before it had passed: its marker recorded only
    its own, so C waited 10 s while A wrote on (outside tester, round 3). A claim over a held
    marker records the longer of the two."""
    anyio.run(Fence(store, window=30.0, margin=8.0).claim)  # A, running
    now = [1000.0]
    b = Fence(store, window=2.0, margin=8.0, clock=lambda: now[0])
    anyio.run(b.claim)  # B claims (and dies: its marker stays held)
    c = Fence(store, window=2.0, margin=8.0, clock=lambda: now[0])
    anyio.run(c.claim)
    assert c.writable_at == 1000.0 + 30.0 + 8.0
    assert anyio.run(read_marker, store)["window"] == 30.0  # C records it on in turn
