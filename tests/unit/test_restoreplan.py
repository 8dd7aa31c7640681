"""The restore's pure decisions (sidecar.restore.plan): which roots, which files, what is recorded."""

from __future__ import annotations

from sidecar.marker import marker_generation, next_stamp
from sidecar.restore.plan import (
    Candidates,
    Disk,
    FileAction,
    bundle_wins,
    commits_begun_meanwhile,
    decide_restore,
    decide_roots,
    file_action,
    holds,
    may_restore,
    names_generated,
    plan_candidates,
    plan_finish,
    stored_counts,
)
from sidecar.restorefs import Lineage

EMPTY, HELD, FOREIGN, CUT = Disk(False, False, False), Disk(True, False, True), Disk(True, False, False), Disk(True, True, True)


def test_restore_rule():
    assert decide_restore("r", local_has_files=False, stored=3, mode="auto").restore
    assert not decide_restore("r", local_has_files=True, stored=3, mode="auto", held=True).restore
    assert decide_restore("r", local_has_files=True, stored=3, mode="force").restore
    assert not decide_restore("r", local_has_files=False, stored=3, mode="skip").restore
    assert not decide_restore("r", local_has_files=False, stored=0, mode="auto").restore


def test_a_cut_short_restore_is_not_the_truth():
    d = decide_restore("r", local_has_files=True, stored=3, mode="auto", cut_short=True)
    assert d.restore and "cut short" in d.reason
    assert not decide_restore("r", local_has_files=True, stored=3, mode="skip", cut_short=True).restore
    assert not decide_restore("r", local_has_files=True, stored=0, mode="auto", cut_short=True).restore


def test_a_disk_with_files_is_the_truth_only_when_this_namespace_holds_it():
    held = decide_restore("r", local_has_files=True, stored=3, mode="auto", held=True)
    assert (held.restore, held.merge, held.owned) == (False, False, True)
    assert "the disk is the truth" in held.reason
    # a fresh compute's image, another namespace's or store's volume, a disk of an earlier release
    new = decide_restore("r", local_has_files=True, stored=3, mode="auto", held=False)
    assert (new.restore, new.merge, new.owned) == (True, True, True)
    assert new.reason == "root holds files but no record that this namespace filled it: merging from the store"
    # an empty root is filled whatever its record says; a fill is no merge
    for held_ in (False, True):
        d = decide_restore("r", local_has_files=False, stored=3, mode="auto", held=held_)
        assert (d.restore, d.merge, d.owned) == (True, False, True)


def test_force_skip_and_the_cut_short_marker_keep_their_meaning_with_lineage():
    for held in (False, True):
        forced = decide_restore("r", local_has_files=True, stored=3, mode="force", held=held)
        assert (forced.restore, forced.merge, forced.reason) == (True, False, "forced")
        cut = decide_restore("r", local_has_files=True, stored=3, mode="auto", cut_short=True, held=held)
        assert (cut.restore, cut.merge, cut.owned) == (True, False, True) and "cut short" in cut.reason
    # skip restores nothing; the disk is this namespace's only when it says so (or nothing is stored)
    assert [decide_restore("r", True, 3, "skip", held=h).owned for h in (False, True)] == [False, True]
    assert decide_restore("r", True, 0, "skip").owned
    assert not decide_restore("r", True, 3, "skip", cut_short=True, held=True).owned
    # nothing stored: nothing to merge, and the disk is all there is
    d = decide_restore("r", local_has_files=True, stored=0, mode="auto")
    assert (d.restore, d.merge, d.owned, d.reason) == (False, False, True, "nothing stored")


def test_may_restore_follows_the_rule_before_the_listing_ends():
    assert may_restore(True, "auto") and not may_restore(True, "auto", held=True)
    assert may_restore(False, "auto", held=True) and not may_restore(True, "skip")


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


def test_a_file_named_by_its_roots_bundle_is_superseded_unless_a_later_writer_stored_it():
    assert not bundle_wins(None, 5, "r/a", None)  # the bundle not read yet
    assert not bundle_wins({}, 5, "r/a", None)
    bundle = {"r/a": object()}
    assert bundle_wins(bundle, 5, "r/a", None) and not bundle_wins(bundle, 5, "r/b", None)
    listed = lambda version: ObjectInfo("r/a", 1, None, 0, 0o600, version=version)  # noqa: E731
    assert bundle_wins(bundle, 5, "r/a", listed(4))  # the commit's own object, older than its bundle
    assert bundle_wins(bundle, 0, "r/a", listed(0))  # neither versioned (an old release): the bundle
    assert not bundle_wins(bundle, 5, "r/a", listed(6))  # a later writer's object


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


# -- restore points ------------------------------------------------------------------------------

from dataclasses import dataclass  # noqa: E402

from sidecar.restore.plan import as_of_refused, as_of_time, chain_tree, from_point, point_source  # noqa: E402
from sidecar.store.base import ObjectInfo, ObjectMeta  # noqa: E402


@dataclass(frozen=True)
class E:
    key: str
    sha256: str = "aa"
    version: int = 1
    size: int = 3
    deleted: bool = False

    @property
    def meta(self) -> ObjectMeta | None:
        return None if self.deleted else ObjectMeta(self.size, self.sha256, 0, 0o600, self.version)


def info(key: str, sha256: str | None = "aa", version: int = 1, size: int = 3) -> ObjectInfo:
    return ObjectInfo(key, size, sha256, 0, 0o600, version=version)


def test_a_chains_tree_is_its_full_point_with_each_increment_applied_in_order():
    full = [E("r/a"), E("r/b"), E("r/c")]
    incr1 = [E("r/a", "bb", 2), E("r/c", deleted=True), E("r/d")]
    incr2 = [E("r/d", deleted=True), E("r/c", "cc", 3)]
    tree = chain_tree([full, incr1, incr2])
    assert {k: (i, e.meta.sha256, e.meta.version) for k, (i, e) in tree.items()} == {
        "r/a": (1, "bb", 2), "r/b": (0, "aa", 1), "r/c": (2, "cc", 3)}
    assert chain_tree([]) == {}


def test_a_listed_object_comes_from_the_point_only_with_the_same_version_and_bytes():
    e = E("r/a")
    assert from_point(info("r/a"), e, merging=False, max_file_size=10)
    assert not from_point(info("r/a", version=2), e, merging=False, max_file_size=10)  # rewritten after the point
    assert not from_point(info("r/a", sha256="bb"), e, merging=False, max_file_size=10)
    assert not from_point(info("r/a", sha256=None), e, merging=False, max_file_size=10)  # unverifiable
    assert not from_point(info("r/a", size=4), E("r/a", size=4), merging=False, max_file_size=3)  # refused as too large
    assert not from_point(info("r/a"), e, merging=True, max_file_size=10)  # merged: compared with the disk per file
    assert not from_point(info("r/a"), None, merging=False, max_file_size=10)  # written after the point


def test_point_sources_split_the_listing_and_never_resurrect_a_deleted_key():
    tree = chain_tree([[E("r/a"), E("r/b"), E("r/gone"), E("m/x")], [E("r/b", "bb", 2)]])
    listed = [info("r/a"), info("r/b", "bb", 2), info("r/new"), info("r/a2"), info("m/x")]
    points: dict[int, list[str]] = {}
    objects: list[str] = []
    for i in listed:
        index = point_source(i, tree, merging=i.key.startswith("m/"), max_file_size=2**63)
        if index is None:
            objects.append(i.key)
        else:
            points.setdefault(index, []).append(i.key)
    assert points == {0: ["r/a"], 1: ["r/b"]}
    assert objects == ["r/new", "r/a2", "m/x"]  # "r/gone" is in neither: deleted after the point


def test_as_of_fills_empty_roots_only_unless_forced_and_measures_ages_on_the_store_clock():
    has_files = {"empty": False, "held": True, "cut": True}
    assert as_of_refused(has_files, force=False) == ["held", "cut"]
    assert as_of_refused(has_files, force=True) == []
    assert as_of_time(1000.0, None, None) == 1000.0
    assert as_of_time(None, 60.0, 5000.0) == 4940.0
    assert as_of_time(None, 60.0, None) is None


def test_the_point_that_should_hold_a_version_is_the_first_written_after_it():
    from sidecar.restore.plan import holding_point

    seqs = [110, 120, 130]
    assert holding_point(105, seqs) == 110
    assert holding_point(110, seqs) == 120  # a point's own seq is never a file's version
    assert holding_point(125, seqs) == 130
    assert holding_point(130, seqs) is None and holding_point(500, seqs) is None  # written after the newest
    assert holding_point(1, []) is None
