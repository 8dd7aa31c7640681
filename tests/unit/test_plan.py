from sidecar.localfs import LocalStat
from sidecar.plan import decide_restore, plan_reconcile, plan_status
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
    plan = plan_reconcile({}, remote, protected_roots={"r"})
    assert plan.delete == ["s/b"]


def test_restore_rule():
    assert decide_restore("r", local_has_files=False, stored=3, mode="auto").restore
    assert not decide_restore("r", local_has_files=True, stored=3, mode="auto").restore
    assert decide_restore("r", local_has_files=True, stored=3, mode="force").restore
    assert not decide_restore("r", local_has_files=False, stored=3, mode="skip").restore
    assert not decide_restore("r", local_has_files=False, stored=0, mode="auto").restore


def test_a_cut_short_restore_is_not_the_truth():
    d = decide_restore("r", local_has_files=True, stored=3, mode="auto", cut_short=True)
    assert d.restore and "cut short" in d.reason
    assert not decide_restore("r", local_has_files=True, stored=3, mode="skip", cut_short=True).restore
    assert not decide_restore("r", local_has_files=True, stored=0, mode="auto", cut_short=True).restore


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
    plan = plan_reconcile({}, remote, protected_roots={".d"}, keep={".c/a.json"}, gaps=gaps)
    # refused at restore (keep), below an unreadable directory (gaps), a protected root: kept
    assert plan.delete == [".c/gone.json", ".c/subway.json"]
    assert Gaps(unreadable={".c": "EIO"}).covers(".c/anything") and not gaps.covers(".c/subway.json")


def test_status_is_not_in_sync_with_gaps():
    from sidecar.localfs import Gaps
    from sidecar.plan import plan_status

    assert plan_status({}, {}).ok
    assert not plan_status({}, {}, Gaps(unreadable={".c/x": "Permission denied"})).ok
    assert not plan_status({}, {}, Gaps(unstorable=[".c/" + "x" * 2000])).ok
