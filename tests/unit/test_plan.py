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
