"""The pure rules of sessions and prune: namespaces from a streamed listing, owners, eligibility."""

from __future__ import annotations

import pytest

from sidecar.ops.sessionplan import LIVE, NONE, PRUNING, RELEASED, STALE, UNKNOWN, Grouper, owner, prunable
from sidecar.store.base import ObjectInfo


def info(key: str, size: int = 1, modified: float = 100.0) -> ObjectInfo:
    return ObjectInfo(key, size, None, 0, 0o600, None, 0, modified)


def group(keys: list[str]) -> dict[str, tuple[int, int, int, int, bool]]:
    """namespace -> (files, objects, bytes, points, has marker), fed in sorted (Azure) order."""
    g = Grouper()
    out = []
    for k in sorted(keys):
        out += g.add(info(k))
    out += g.finish()
    names = [x.namespace for x in out]
    assert len(names) == len(set(names)), f"a namespace closed twice: {names}"
    return {x.namespace: (x.files, x.objects, x.bytes, x.points, x.marker is not None) for x in out}


def test_sessions_are_the_directories_with_sidecar_objects():
    got = group(["a/_/s1/.checkpoints/x.json", "a/_/s1/.checkpoints/y.json", "a/_/s1/.sidecar/owner",
                 "a/_/s1/.sidecar/points/p1", "a/_/s1/.sidecar/points/p2",
                 "a/_/s1-b/.sidecar/owner", "a/_/s10/.sidecar/owner", "a/_/s10/.checkpoints/deep/z"])
    assert got == {"a/_/s1": (2, 5, 5, 2, True), "a/_/s1-b": (0, 1, 1, 0, True), "a/_/s10": (1, 2, 2, 0, True)}


def test_files_outside_every_namespace_belong_to_the_top():
    got = group([".checkpoints/old.json", "legacy/x", "s1/.sidecar/owner", "s1/.checkpoints/a"])
    assert got == {"s1": (1, 2, 2, 0, True), "": (2, 2, 2, 0, False)}


def test_nested_namespaces_are_apart_from_their_parent():
    got = group(["a/.sidecar/owner", "a/.checkpoints/x", "a/s1/.sidecar/owner", "a/s1/.checkpoints/y",
                 ".sidecar/owner"])
    assert got == {"a/s1": (1, 2, 2, 0, True), "a": (1, 2, 2, 0, True), "": (0, 1, 1, 0, True)}


def test_a_namespace_without_marker_but_with_its_own_objects_is_one():
    got = group(["s1/.sidecar/points/p", "s1/.checkpoints/a"])
    assert got == {"s1": (1, 2, 2, 1, False)}


def test_the_directory_stores_records_are_not_objects():
    got = group(["s1/.sidecar/owner", "s1/.sidecar-meta/.sidecar/owner.json", "s1/.sidecar-meta/.sidecar-lock"])
    assert got == {"s1": (0, 1, 1, 0, True)}


def test_an_empty_store_has_no_namespace():
    assert group([]) == {}


def test_depth_first_order_works_too():
    # the directory store walks depth first, in no name order
    g = Grouper()
    out = []
    for k in ["s2/.checkpoints/a", "s2/.sidecar/owner", "x/y", "s1/.sidecar/owner"]:
        out += g.add(info(k))
    out += g.finish()
    assert sorted(x.namespace for x in out) == ["", "s1", "s2"]


def test_last_write_is_the_newest_object():
    g = Grouper()
    out = g.add(info("s/.checkpoints/a", modified=5)) + g.add(info("s/.sidecar/owner", modified=3)) + g.finish()
    assert out[0].last_write == 5


@pytest.mark.parametrize("marker, modified, expected", [
    (None, None, NONE),
    ({}, None, NONE),
    ({"_unreadable": "x"}, 1.0, UNKNOWN),
    ({"heartbeat": 0, "generation": 1}, 0.0, RELEASED),
    ({"heartbeat": 5, "prune": {"phase": "pending"}}, 999.0, PRUNING),
    ({"heartbeat": 5}, 999.0, LIVE),  # 1 s old, 60 s threshold
    ({"heartbeat": 5}, 900.0, STALE),  # 100 s old
    ({"heartbeat": 5, "interval": 0}, 0.0, LIVE),  # never rewritten: never taken for ended
    ({"heartbeat": 5, "interval": 900}, 0.0, LIVE),  # twice its interval wins over --live-within
    ({"heartbeat": 5, "interval": 10}, 900.0, STALE),
    ({"heartbeat": 5}, None, LIVE),  # no time known: not taken for ended
])
def test_owner_is_told_by_the_store_clock(marker, modified, expected):
    assert owner(marker, modified, now=1000.0, live_within=60.0) == expected


def test_eligibility():
    now = 1000.0
    assert prunable(RELEASED, 100.0, {}, 100.0, now, older_than=600, live_within=60)
    assert not prunable(RELEASED, 500.0, {}, 500.0, now, older_than=600, live_within=60)
    assert prunable(RELEASED, 999.0, {}, 999.0, now, older_than=0, live_within=60)
    assert prunable(NONE, 100.0, {}, None, now, older_than=0, live_within=60)
    assert not prunable(LIVE, 0.0, {}, 0.0, now, older_than=0, live_within=60)
    assert not prunable(UNKNOWN, 0.0, {}, 0.0, now, older_than=0, live_within=60)
    # stale, but a file written lately: not gone
    assert not prunable(STALE, 990.0, {}, 100.0, now, older_than=0, live_within=60)
    assert prunable(STALE, 900.0, {}, 100.0, now, older_than=0, live_within=60)
    # a prune that died is finished once its marker is old
    assert prunable(PRUNING, 0.0, {}, 900.0, now, older_than=600, live_within=60)
    assert not prunable(PRUNING, 0.0, {}, 990.0, now, older_than=0, live_within=60)


def test_a_dead_prunes_deleting_marker_is_finished_at_once_when_it_proves_the_prune_owned_it():
    """A prune writes ``deleting`` only after its grace, by a swap from its own pending marker:
    no live session is behind it, so the next prune need not wait --live-within. Only such a
    marker: a prune's owner, stored at the stamp it records (unless the version is not known)."""
    from sidecar.marker import STORED_VERSION

    now, stamp = 1000.0, 7 << 32
    proven = {"generation": stamp, "owner": "prune:ab", "prune": {"phase": "deleting"}, STORED_VERSION: stamp}
    assert prunable(PRUNING, 999.0, proven, 999.0, now, older_than=7 * 86400, live_within=3600)
    for unproven in ({**proven, "owner": "resuming:ab"}, {**proven, STORED_VERSION: 3 << 32},
                     {**proven, "prune": {"phase": "pending"}}, {**proven, "generation": "junk"}):
        assert not prunable(PRUNING, 999.0, unproven, 999.0, now, older_than=0, live_within=3600), unproven
    # a listing's read knows no version: the fields alone, the pruner decides again with it
    copied = {**proven, STORED_VERSION: 3 << 32}
    assert prunable(PRUNING, 999.0, copied, 999.0, now, older_than=0, live_within=3600, versions=False)
