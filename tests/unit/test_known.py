"""StoreState: what the store is known to hold (sidecar.known)."""

from __future__ import annotations

from sidecar.known import StoreState
from sidecar.listing import Listing
from sidecar.store.base import ObjectInfo


def info(key):
    return ObjectInfo(key, 1, "h", 10, 0o600)


def test_built_from_a_listing_with_its_directories_and_own_bundles():
    listing = Listing(objects={"r/a/b/c.json": info("r/a/b/c.json")}, bundles={"r", "other"})
    state = StoreState.from_listing(listing, snapshot_roots={"r", "s"})
    assert state.keys() == {"r/a/b/c.json"}
    assert state.has_dir("r/a/b") and state.has_dir("r/a") and state.has_dir("r")
    assert not state.has_dir("r/a/b/c.json")
    assert state.bundles() == {"r"}  # another root's bundle is not ours


def test_our_writes_update_it():
    state = StoreState()
    state.stored("r/d/x", info("r/d/x"))
    state.stored("r/d/y", info("r/d/y"))
    state.stored("r/dz", info("r/dz"))
    assert state.get("r/d/x") == info("r/d/x") and "r/d/x" in state and state.has_dir("r/d")
    assert sorted(state.keys_below("r/d/")) == ["r/d/x", "r/d/y"]
    assert state.objects_in({"r"}).keys() == {"r/d/x", "r/d/y", "r/dz"} and state.objects_in({"s"}) == {}
    state.deleted("r/d/x")
    state.deleted("r/never")
    assert state.get("r/d/x") is None and state.keys() == {"r/d/y", "r/dz"}
    assert state.has_dir("r/d")  # never pruned


def test_keys_is_a_copy():
    state = StoreState({"r/a": info("r/a")})
    before = state.keys()
    state.stored("r/b", info("r/b"))
    assert before == {"r/a"}


def test_bundles():
    state = StoreState()
    assert not state.has_bundle("r")
    state.add_bundle("r")
    assert state.has_bundle("r") and state.bundles() == {"r"}
    state.discard_bundle("r")
    state.discard_bundle("r")
    assert state.bundles() == set()


def test_what_a_file_replaces_the_other_shape():
    state = StoreState()
    for k in ("r/a", "r/d/x", "r/d/e/y", "r/dz"):
        state.stored(k, info(k))
    assert state.replaced_by("r/a/x") == ["r/a"]  # a file where a directory goes now
    assert state.replaced_by("r/a/b/c") == ["r/a"]
    assert sorted(state.replaced_by("r/d")) == ["r/d/e/y", "r/d/x"]  # a file where the directory was
    assert state.replaced_by("r/d/e") == ["r/d/e/y"]
    assert state.replaced_by("r/dz") == [] and state.replaced_by("r/new") == []


def test_a_listings_stale_shape_is_known_so_a_reconcile_deletes_it():
    listing = Listing(objects={"r/a/x": info("r/a/x")}, stale={"r/a": info("r/a")})
    state = StoreState.from_listing(listing, snapshot_roots=())
    assert state.keys() == {"r/a", "r/a/x"}
