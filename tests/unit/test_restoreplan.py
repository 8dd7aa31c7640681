"""The restore's pure decisions (sidecar.restoreplan): which roots, which files, what is recorded."""

from __future__ import annotations

from sidecar.fence import marker_generation, next_stamp
from sidecar.restorefs import Lineage
from sidecar.restoreplan import (
    Candidates,
    Disk,
    FileAction,
    commits_begun_meanwhile,
    decide_roots,
    file_action,
    holds,
    names_generated,
    plan_candidates,
    plan_finish,
    stored_counts,
    superseded,
)

EMPTY, HELD, FOREIGN, CUT = Disk(False, False, False), Disk(True, False, True), Disk(True, False, False), Disk(True, True, True)


def test_candidates_come_from_the_disk_alone():
    disk = {"empty": EMPTY, "held": HELD, "foreign": FOREIGN, "cut": CUT}
    assert plan_candidates(disk, "auto") == Candidates(frozenset({"empty", "foreign", "cut"}), frozenset({"foreign"}))
    assert plan_candidates(disk, "force") == Candidates(frozenset(disk), frozenset())
    assert plan_candidates(disk, "skip") == Candidates(frozenset(), frozenset())


def test_stored_counts_apply_each_roots_bundle():
    listed = ["r/a", "r/b", "s/c"]
    bundled = {"r": {"r/a": True, "r/new": False, "r/b": False}, "s": {"s/gone": True}}
    # r/a deleted by the bundle, r/new only in the bundle, r/b listed and rewritten; s/gone never listed
    assert stored_counts(["r", "s", "t"], listed, bundled) == {"r": 2, "s": 1, "t": 0}


def test_decisions_once_the_listing_ended_follow_the_rule_in_root_order():
    disk = {"empty": EMPTY, "held": HELD, "foreign": FOREIGN}
    ds = decide_roots(disk, {"empty": 0, "held": 3, "foreign": 2}, "auto")
    assert [(d.name, d.restore, d.merge) for d in ds] == [("empty", False, False), ("held", False, False),
                                                          ("foreign", True, True)]


def test_a_bundle_listed_but_read_as_absent_is_a_commit_begun_meanwhile():
    assert commits_begun_meanwhile(["r", "s", "t"], listed_bundles={"r", "s"}, read_bundles={"s"}) == ["r"]
    assert commits_begun_meanwhile(["r"], listed_bundles=set(), read_bundles=set()) == []


def test_file_action_refuses_too_large_and_merges_by_content():
    assert file_action(11, 10) is FileAction.REFUSE_TOO_LARGE
    assert file_action(11, 10, local_same=True) is FileAction.REFUSE_TOO_LARGE  # refused before anything else
    assert file_action(10, 10) is FileAction.WRITE  # a root being filled
    assert file_action(10, 10, local_same=None) is FileAction.WRITE  # merged, no local file
    assert file_action(10, 10, local_same=True) is FileAction.IN_PLACE
    assert file_action(10, 10, local_same=False) is FileAction.REPLACE


def test_a_file_named_by_its_roots_bundle_is_superseded():
    assert not superseded(None, "r/a")  # the bundle not read yet
    assert not superseded({}, "r/a")
    assert superseded({"r/a": object()}, "r/a") and not superseded({"r/a": object()}, "r/b")


def test_only_checkpoints_held_in_memory_are_searched_for_generated_names():
    assert names_generated(".checkpoints/x", streamed=False) and names_generated("r/a.json", streamed=False)
    assert not names_generated("r/a.bin", streamed=False) and not names_generated("r/a.json", streamed=True)


def test_finish_records_filled_roots_clears_emptied_cut_short_ones_and_records_the_rest():
    disk = {"filled": EMPTY, "cut_gone": Disk(True, True, False), "nothing": FOREIGN, "held": HELD}
    ds = decide_roots(disk, {"filled": 2, "cut_gone": 0, "nothing": 0, "held": 1}, "auto")
    f = plan_finish(ds, disk, candidates={"filled", "cut_gone", "nothing"}, started={"filled"})
    assert f.filled == ["filled"]
    assert f.cleared == ["cut_gone"]  # nothing stored any more: the disk is all there is
    # owned and not yet recorded; "held" carries the record already, "filled" is recorded with its files
    assert f.recorded == ["cut_gone", "nothing"]


def test_a_disk_is_held_only_by_its_store_and_namespace_at_the_markers_generation_or_later():
    ours = Lineage("file:///s", "ns1", 0)
    assert holds(Lineage("file:///s", "ns1", 3), ours, 3)  # the same disk: nobody moved on
    assert holds(Lineage("file:///s", "ns1", 4), ours, 3)  # the marker rolled back or lost: still ours
    assert not holds(Lineage("file:///s", "ns1", 2), ours, 3)  # an older copy: another compute moved on
    assert not holds(Lineage("file:///s", "ns1", None), ours, 0)  # a record without a generation
    assert not holds(Lineage("file:///s", "ns2", 3), ours, 3)
    assert not holds(Lineage("file:///t", "ns1", 3), ours, 3)
    assert not holds(None, ours, 0)


def test_the_markers_generation_is_its_stamps_high_bits_or_its_stored_versions():
    stamp = next_stamp(next_stamp(0))
    assert marker_generation({}) == 0
    assert marker_generation({"generation": stamp, "_stored_version": stamp}) == 2
    assert marker_generation({"_stored_version": stamp, "_unreadable": "not a JSON object"}) == 2
    assert marker_generation({"generation": "garbled"}) == 0
