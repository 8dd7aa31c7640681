"""The owner marker has one writer, :mod:`sidecar.marker` (issue #36, item 1): no other module puts
or deletes its key; it records the owner's write window, and prune's grace waits the owner's
when longer than its own; a claim that waits out a prune's leftover ``pending`` marker says
it was the prune's, not a sidecar's that did not release."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest
from memstore import FakeClock, MemorySpace

from sidecar.fence import Fence
from sidecar.marker import (
    MAX_RECORDED_WAIT,
    PRUNE_OWNER,
    PRUNE_PENDING,
    Marker,
    read_marker,
    recorded_wait,
    swap,
)
from sidecar.ops.namespaces import StoreClock, walk
from sidecar.ops.pruner import PRUNED, Pruner
from sidecar.takeover import take_for_restore

SIDECAR = Path(__file__).resolve().parents[2] / "sidecar"
IDENTITY = {"FOUNDRY_AGENT_SESSION_ID": "s1"}
MUTATIONS = {"put", "delete", "delete_if", "put_stream"}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def test_only_the_marker_module_writes_the_owner_key():
    """A put or delete whose key is (or is built from) OWNER_KEY anywhere in sidecar/ but
    sidecar/marker.py: the marker's writes go through marker.swap and marker.remove."""
    found = []
    for path in sorted(SIDECAR.rglob("*.py")):
        if path == SIDECAR / "marker.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATIONS
                    and node.args and "OWNER_KEY" in _names(node.args[0])):
                found.append(f"{path.relative_to(SIDECAR)}:{node.lineno}")
    assert found == []


@pytest.fixture
def fence_log(caplog):
    """The fence_wait lines' details (the sidecar's logger, whatever set it up before)."""
    logger = logging.getLogger("checkpoint_sidecar")
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = True  # to caplog's handler (log.setup stops it)
    yield lambda: [r.fields["detail"] for r in caplog.records if r.getMessage() == "fence_wait"]  # type: ignore[attr-defined]
    logger.setLevel(level)
    logger.propagate = propagate


async def _prune_grace(space: MemorySpace, window: float, margin: float) -> list[float]:
    """What a prune of the namespace ``s1`` (released: eligible at once) sleeps, its own window
    and margin being ``window`` and ``margin``."""
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    top = space.store()
    clock = await StoreClock.of(top)
    pruner = Pruner(lambda ns: space.store(ns), clock.now, window, margin, 0.0, 60.0, sleep=sleep)
    results = [await pruner.prune(ns) async for ns in walk(top, 60.0, clock)]
    assert [(r.namespace, r.outcome) for r in results] == [("s1", PRUNED)], results
    return slept


@pytest.mark.anyio
async def test_a_prune_waits_the_owners_recorded_write_window():
    """The owner ran with a longer SIDECAR_FENCE_WINDOW + MARGIN (40 s) than the prune (10 s):
    its marker records them and the prune's grace waits them (before: its own 10 s, so a stale
    owner still inside its window could write after the prune began deleting)."""
    space = MemorySpace(FakeClock())
    store = space.store("s1")
    fence = Fence(store, 30.0, 10.0, identity=IDENTITY, namespace="s1", clock=space.clock, sleep=space.clock.sleep)
    await fence.claim()
    await fence.release(1.0)
    marker = await read_marker(store)
    assert (marker["window"], marker["margin"], marker["heartbeat"]) == (30.0, 10.0, 0)
    assert await _prune_grace(space, 2.0, 8.0) == [40.0]


@pytest.mark.anyio
@pytest.mark.parametrize("recorded, grace", [({}, 10.0), ({"window": 1.0, "margin": 1.0}, 10.0),
                                             ({"window": "x", "margin": None}, 10.0),
                                             ({"window": 1e12, "margin": 5.0}, MAX_RECORDED_WAIT)])
async def test_a_prune_waits_its_own_window_unless_the_owner_recorded_a_longer_one(recorded, grace):
    """A marker of an earlier release (no window), a shorter or malformed one: the prune's own;
    an absurd one: at most MAX_RECORDED_WAIT."""
    space = MemorySpace(FakeClock())
    body = json.dumps({"generation": 5 << 32, "owner": "x" * 32, "heartbeat": 0, **recorded}).encode()
    await swap(space.store("s1"), Marker.put_back(json.loads(body)), 5 << 32)
    assert await _prune_grace(space, 2.0, 8.0) == [grace]


async def _pending_prune_marker(store) -> None:
    """What a prune killed in its grace leaves: its pending marker over a sidecar's (not released)."""
    await swap(store, Marker(5 << 32, "o" * 32, 1.0, IDENTITY), 5 << 32)
    await swap(store, Marker(6 << 32, PRUNE_OWNER + "x" * 32, 2.0, IDENTITY, phase=PRUNE_PENDING), 6 << 32,
               if_version=5 << 32)


@pytest.mark.anyio
@pytest.mark.parametrize("taken", [True, False])
async def test_a_claim_after_a_killed_prune_says_the_marker_was_the_prunes(fence_log, taken):
    """Issue #36: after a prune died with its pending marker left, the resuming sidecar waits out a
    write window (whether the owner before the prune released cannot be told) and said the
    previous sidecar had not released the namespace. It says a prune left its marker, whether
    the start-up took that marker over (``taken``) or the claim found it."""
    space = MemorySpace(FakeClock())
    store = space.store("s1")
    await _pending_prune_marker(store)
    found = await take_for_restore(store, IDENTITY, "s1") if taken else None
    assert found is None or found.stamp
    fence = Fence(store, 2.0, 8.0, identity=IDENTITY, namespace="s1", clock=space.clock, sleep=space.clock.sleep,
                  taken=found)
    await fence.claim()
    assert fence.waited
    [detail] = fence_log()
    assert "a prune that did not end" in detail and "previous sidecar did not release" not in detail, detail


@pytest.mark.anyio
async def test_a_claim_after_an_owner_that_did_not_release_still_says_so(fence_log):
    space = MemorySpace(FakeClock())
    store = space.store("s1")
    await swap(store, Marker(5 << 32, "o" * 32, 1.0, IDENTITY), 5 << 32)
    fence = Fence(store, 2.0, 8.0, identity=IDENTITY, namespace="s1", clock=space.clock, sleep=space.clock.sleep)
    await fence.claim()
    [detail] = fence_log()
    assert detail.startswith("the previous sidecar did not release this namespace"), detail


def test_a_marker_of_an_earlier_release_is_read_as_it_was_written():
    """Every field but generation is optional, and a marker put back is written unchanged."""
    old = {"generation": 3, "owner": "a" * 32, "heartbeat": 12.5, "unknown": [1]}
    assert json.loads(Marker.put_back({**old, "_stored_version": 3}).body()) == old
    assert recorded_wait(old) == 0.0
    assert json.loads(Marker(7, "b", 0).body()) == {"generation": 7, "owner": "b", "heartbeat": 0}
