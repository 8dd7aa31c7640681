import pytest

from sidecar.localfs import LocalStat
from sidecar.plan import Protected, plan_reconcile, plan_status
from sidecar.store.base import ObjectInfo


def info(key, size=1, mtime=10, sha="h", mode=0o600):
    return ObjectInfo(key, size, sha, mtime, mode)


def test_reconcile_uploads_missing_and_stale_and_deletes_gone():
    local = {"r/a": LocalStat(1, 10, 0o600), "r/b": LocalStat(2, 20, 0o600), "r/c": LocalStat(1, 10, 0o600)}
    remote = {"r/a": info("r/a"), "r/b": info("r/b", size=2, mtime=19), "r/gone": info("r/gone")}
    plan = plan_reconcile(local, remote)
    assert plan.upload == ["r/b", "r/c"]
    assert plan.delete == ["r/gone"]
    assert plan.in_sync == 1


def test_unknown_hash_is_rewritten():
    plan = plan_reconcile({"r/a": LocalStat(1, 10, 0o600)}, {"r/a": info("r/a", sha=None)})
    assert plan.upload == ["r/a"]


def test_protected_roots_are_never_emptied():
    remote = {"r/a": info("r/a"), "s/b": info("s/b")}
    plan = plan_reconcile({}, remote, Protected(roots=frozenset({"r"})))
    assert plan.delete == ["s/b"]


def test_status():
    s = plan_status({"r/a": LocalStat(1, 10, 0o600), "r/new": LocalStat(1, 1, 0o600)},
                    {"r/a": info("r/a"), "r/old": info("r/old")})
    assert s.in_sync == ["r/a"] and s.pending_upload == ["r/new"] and s.missing_locally == ["r/old"]
    assert not s.ok


def test_reconcile_never_deletes_what_it_could_not_see_or_place():
    from sidecar.localfs import Gaps
    from sidecar.plan import plan_reconcile
    from sidecar.store.base import ObjectInfo

    def info(key):
        return ObjectInfo(key, 1, "ab", 1, 0o600)

    remote = {k: info(k) for k in (".c/a.json", ".c/sub/x.json", ".c/subway.json", ".c/gone.json", ".d/y.json")}
    gaps = Gaps(unreadable={".c/sub": "Permission denied"})
    plan = plan_reconcile({}, remote, Protected(frozenset({".d"}), frozenset({".c/a.json"}), gaps))
    # refused at restore (keep), below an unreadable directory (gaps), a protected root: kept
    assert plan.delete == [".c/gone.json", ".c/subway.json"]
    assert Gaps(unreadable={".c": "EIO"}).covers(".c/anything") and not gaps.covers(".c/subway.json")


def test_status_is_not_in_sync_with_gaps():
    from sidecar.localfs import Gaps
    from sidecar.plan import plan_status

    assert plan_status({}, {}).ok
    assert not plan_status({}, {}, Gaps(unreadable={".c/x": "Permission denied"})).ok
    assert not plan_status({}, {}, Gaps(unstorable=[".c/" + "x" * 2000])).ok


# -- what a reconcile queues while live writes go on (plan_reconcile_queue) --------------------


def queue(local, known, **kw):
    from sidecar.plan import plan_reconcile_queue

    kw.setdefault("known_before", set(known))
    kw.setdefault("busy", set())
    return plan_reconcile_queue(local, known, **kw)


def test_a_key_stored_while_the_scan_ran_is_never_deleted():
    # the scan passed r/ctx before r/ctx/new was written; its upload was done before the scan ended
    known = {"r/ctx/old": info("r/ctx/old"), "r/ctx/new": info("r/ctx/new")}
    plan = queue({"r/ctx/old": LocalStat(1, 10, 0o600)}, known, known_before={"r/ctx/old"})
    assert plan.delete == []
    # the same key, known before the scan began and absent from it, is a candidate
    assert queue({"r/ctx/old": LocalStat(1, 10, 0o600)}, known).delete == ["r/ctx/new"]


def test_a_full_listing_predates_the_scan_so_every_listed_key_may_be_deleted():
    plan = queue({}, {"r/a": info("r/a"), "r/b": info("r/b")}, known_before=None)
    assert plan.delete == ["r/a", "r/b"]


def test_busy_keys_are_left_to_their_pending_operation():
    local = {"r/new": LocalStat(1, 10, 0o600), "r/stale": LocalStat(2, 20, 0o600)}
    known = {"r/stale": info("r/stale"), "r/gone": info("r/gone"), "r/gone2": info("r/gone2")}
    plan = queue(local, known, busy={"r/new", "r/gone"})
    assert plan.upload == ["r/stale"]
    assert plan.delete == ["r/gone2"]
    full = queue(local, known, known_before=None, busy={"r/stale", "r/gone2"})
    assert (full.upload, full.delete) == (["r/new"], ["r/gone"])


def test_a_skipped_file_is_queued_again_only_once_it_changed():
    from sidecar.known import StoreState

    state = StoreState()
    assert state.skip("r/big", (5, 10, 11))
    assert not state.skip("r/big", (5, 10, 11))  # that version: counted and logged already
    unchanged, changed = LocalStat(5, 10, 0o600, ctime_ns=11), LocalStat(6, 12, 0o600, ctime_ns=13)
    assert queue({"r/big": unchanged}, {}, still_skipped=state.still_skipped).upload == []
    assert queue({"r/big": changed}, {}, still_skipped=state.still_skipped).upload == ["r/big"]
    state.unskip("r/big")
    assert queue({"r/big": unchanged}, {}, still_skipped=state.still_skipped).upload == ["r/big"]


def test_kept_roots_and_keys_and_gaps_are_never_deleted():
    from sidecar.localfs import Gaps

    known = {k: info(k) for k in ("r/kept", "r/sub/x", "r/gone", "p/y")}
    for known_before in (set(known), None):
        protected = Protected(frozenset({"p"}), frozenset({"r/kept"}), Gaps(unreadable={"r/sub": "Permission denied"}))
        plan = queue({}, known, known_before=known_before, protected=protected)
        assert plan.delete == ["r/gone"]


def test_a_full_listing_replaces_beliefs_except_for_busy_keys():
    from sidecar.known import StoreState

    old, new = info("r/a", size=1), info("r/a", size=2)
    state = StoreState({"r/a": old, "r/busy": old, "r/dropped": old, "s/other": old})
    state.replace({"r"}, {"r/a": new, "r/busy": new, "r/listed/x": new}, busy={"r/busy"})
    assert state.get("r/a") is new  # the listing is newer than what we believed
    assert state.get("r/busy") is old  # its pending operation records its own outcome
    assert "r/dropped" not in state  # not listed: not in the store
    assert state.get("s/other") is old  # a root not listed keeps what was believed of it
    assert state.get("r/listed/x") is new and state.has_dir("r/listed")


# -- a file and a directory of one name (ShapeConflicts) -------------------------------------------

def _v(key, version, mtime=10):
    return ObjectInfo(key, 1, "h", mtime, 0o600, None, version)


def _run_shapes(infos):
    """(restored keys in release order, stale keys) for a listing fed in the given order."""
    from sidecar.plan import ShapeConflicts

    shapes = ShapeConflicts()
    released, stale = [], []
    for i in infos:
        stale += shapes.add(i)
        released += [r.key for r in shapes.settled()]
    released += [r.key for r in shapes.settled(end=True)]
    return released, stale


def test_shape_conflicts_the_newer_shape_wins():
    from sidecar.plan import newer_shape

    assert newer_shape(_v("a", 2), _v("b", 1)) and not newer_shape(_v("a", 1), _v("b", 2))
    assert not newer_shape(_v("a", 0, 20), _v("b", 0, 10))  # never the mtime: no versions decide nothing
    # equal versions (an older release's objects): both kept, the restore places the first
    assert _run_shapes([_v("r/a", 0), _v("r/a/x", 0)]) == (["r/a", "r/a/x"], [])
    # a directory that replaced the file (a crash before the file's object was deleted)
    assert _run_shapes([_v("r/a", 1), _v("r/a/x", 5), _v("r/a/y", 6), _v("r/b", 2)]) == (
        ["r/a/x", "r/a/y", "r/b"], ["r/a"])
    # a file that replaced the directory
    assert _run_shapes([_v("r/a", 9), _v("r/a/x", 5), _v("r/a/y", 6), _v("r/b", 2)]) == (
        ["r/a", "r/b"], ["r/a/x", "r/a/y"])
    # swapped twice: dir a/x (1), then file a (5), then dir a/y (9): a/x died when a was written
    released, stale = _run_shapes([_v("r/a", 5), _v("r/a/x", 1), _v("r/a/y", 9)])
    assert released == ["r/a/y"] and sorted(stale) == ["r/a", "r/a/x"]
    # nested: a file a/x below a stale file a still decides against its own subtree
    released, stale = _run_shapes([_v("r/a", 2), _v("r/a/x", 7), _v("r/a/x/y", 4), _v("r/a/z", 8)])
    assert released == ["r/a/x", "r/a/z"] and sorted(stale) == ["r/a", "r/a/x/y"]


def test_shape_conflicts_hold_each_object_only_until_nothing_below_it_can_come():
    from sidecar.plan import ShapeConflicts

    shapes = ShapeConflicts()
    # names sorting between "r/a" and "r/a/..." ('-', '.' come before '/') keep "r/a" held
    for key in ("r/a", "r/a-1", "r/a.json"):
        assert shapes.add(_v(key, 1)) == []
    assert [i.key for i in shapes.settled()] == ["r/a-1"]  # "r/a.json" > "r/a-10": nothing below r/a-1 can follow
    assert shapes.add(_v("r/a/x", 2)) == ["r/a"]  # "r/a.json" is released by it, "r/a" found stale
    assert [i.key for i in shapes.settled()] == ["r/a.json"]
    assert shapes.add(_v("r/b", 1)) == []  # past "r/a0": r/a/x can have nothing more below it
    assert [i.key for i in shapes.settled()] == ["r/a/x"]
    assert [i.key for i in shapes.settled(end=True)] == ["r/b"]


def test_shape_conflicts_pass_an_unsorted_listing_through():
    """A directory store's walk comes in no name order (and cannot hold both shapes): from the
    first name out of order on, objects are released as they come."""
    released, stale = _run_shapes([_v("r/m", 1), _v("r/z", 1), _v("r/c", 1), _v("r/b", 1)])
    assert sorted(released) == ["r/b", "r/c", "r/m", "r/z"] and stale == []
    from sidecar.plan import ShapeConflicts

    shapes = ShapeConflicts()
    shapes.add(_v("r/z", 1))
    shapes.add(_v("r/c", 1))
    assert [i.key for i in shapes.settled()] == ["r/z", "r/c"]  # nothing held any more
    passing = ShapeConflicts(in_order=False)  # a store that cannot hold both shapes
    assert passing.add(_v("r/a", 1)) == [] and [i.key for i in passing.settled()] == ["r/a"]


def test_protected_is_one_value_for_what_is_never_deleted():
    from sidecar.localfs import Gaps

    p = Protected(roots=frozenset({"p"}), keys=frozenset({"r/kept"}), gaps=Gaps(unreadable={"r/sub": "EIO"}))
    assert p.covers("p/anything") and p.covers("r/kept") and p.covers("r/sub/x")
    assert not p.covers("r/gone") and not p.covers("r/subway") and not p.covers("pp/x")
    assert not Protected().covers("r/a")
    # status reports what is missing locally: nothing protected but what its scan could not see
    assert plan_status({}, {"r/sub/x": info("r/sub/x"), "r/a": info("r/a")},
                       Gaps(unreadable={"r/sub": "EIO"})).missing_locally == ["r/a"]


def test_which_roots_a_reconcile_keeps_and_which_lineage_is_due():
    from sidecar.plan import RootKeep, plan_root_keep

    def keep(**kw):
        facts = dict(initial=True, has_files=True, restored=False, due=False, unproven=False, ours=True,
                     recorded=True, cut_short=False, stored=True)
        return plan_root_keep(**{**facts, **kw})

    assert keep() == RootKeep(empty=False)  # this namespace's disk, with files: the truth
    # an empty root the restore did not fill keeps its stored files until it has files again
    assert keep(has_files=False) == RootKeep(empty=True)
    assert keep(has_files=False, ours=False) == RootKeep(empty=True, unproven=True)
    # ... but one of which nothing is stored is new: nothing to keep, in points from its first upload
    assert keep(has_files=False, stored=False) == RootKeep(empty=None)
    assert keep(has_files=False, stored=False, due=True) == RootKeep(empty=None)  # not made yet: recorded later
    assert keep(has_files=False, stored=False, ours=False) == RootKeep(empty=None, unproven=True)
    assert keep(has_files=False, restored=True) == RootKeep(empty=None)
    assert keep(initial=False, has_files=False) == RootKeep(empty=None)
    # a disk without this namespace's record, at the first reconcile: not the truth
    assert keep(ours=False) == RootKeep(empty=False, unproven=True)
    assert keep(ours=False, due=True) == RootKeep(empty=False)  # to be recorded: this namespace's
    assert keep(initial=False, ours=False) == RootKeep(empty=False)  # classified once, at the start
    # a root whose record went with it (the host removed it) is due again, unless unproven
    assert keep(initial=False, recorded=False) == RootKeep(empty=False, due=True)
    assert keep(initial=False, recorded=False, unproven=True) == RootKeep(empty=False)
    # a cut-short restore not redone keeps the root's stored files
    assert keep(cut_short=True) == RootKeep(empty=False, incomplete=True)
    assert keep(cut_short=True, ours=False) == RootKeep(empty=False, unproven=True, incomplete=True)


def test_a_root_gone_as_a_whole_is_unreadable_not_deleted():
    from sidecar.plan import GONE_EMPTY, GONE_MISSING, RootPresence, plan_root_presence

    def presence(**kw):
        facts = dict(present=True, replaced=False, was_gone=False, stored=True, seen=True, has_files=True)
        return plan_root_presence(**{**facts, **kw})

    assert presence() == RootPresence()  # the directory mirrored: what it lacks, the host deleted
    assert presence(has_files=False) == RootPresence()  # every file deleted one by one, the root kept
    # removed, a mount gone, a file in its place: nothing of it deleted, and said
    assert presence(present=False) == RootPresence(intact=False, gone=GONE_MISSING)
    assert presence(present=False, seen=False, was_gone=True) == RootPresence(intact=False, gone=GONE_MISSING)
    # not made yet by the host, or nothing stored of it: nothing to keep, nothing to say
    assert presence(present=False, seen=False) == RootPresence(intact=False)
    assert presence(present=False, stored=False) == RootPresence(intact=False)
    # back, or another directory in its place, with files: mirrored again
    assert presence(was_gone=True) == RootPresence(returned=True)
    assert presence(replaced=True) == RootPresence(returned=True)
    # back empty (the mount point under a volume that went): still gone while the store holds files
    assert presence(was_gone=True, has_files=False) == RootPresence(intact=False, gone=GONE_EMPTY)
    assert presence(replaced=True, has_files=False) == RootPresence(intact=False, gone=GONE_EMPTY)
    assert presence(replaced=True, has_files=False, stored=False) == RootPresence(returned=True)


@pytest.mark.parametrize("recorded, ours, same", [
    ("http://127.0.0.1:40067/devstoreaccount1/c/p", "http://127.0.0.1:33715/devstoreaccount1/c/p", True),  # a proxy
    ("https://acct.blob.core.windows.net/c", "https://acct.privatelink.blob.core.windows.net/c", True),
    ("https://acct.blob.core.windows.net/c", "https://other.blob.core.windows.net/c", False),
    ("https://acct.blob.core.windows.net/c", "https://acct.blob.core.windows.net/d", False),
    ("http://127.0.0.1:1/devstoreaccount1/c", "http://127.0.0.1:1/otheraccount/c", False),
    ("file:///mnt/a/state", "file:///mnt/b/state", False),
])
def test_a_store_reached_another_way_is_the_same_store(recorded, ours, same):
    """A lineage record names its store by description; the same Azure container through a proxy,
    a private endpoint or another emulator port is the same store (found when a sidecar restarted
    straight to Azurite, after one that went through a proxy, refused its own disk)."""
    from sidecar.restore.plan import foreign, holds
    from sidecar.restorefs import Lineage

    record, lineage = Lineage(recorded, "ns", 5), Lineage(ours, "ns", 5)
    assert foreign(record, lineage) is not same
    assert holds(record, lineage, 5) is same
