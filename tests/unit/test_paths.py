import pytest

from sidecar.paths import IgnoreRules, Root, UnsafeKey, locate, make_roots, split_key, validate_relpath

ROOTS = {r.name: r for r in [Root(".checkpoints", "/w/.checkpoints"), Root(".function_approvals", "/w/.function_approvals")]}


@pytest.mark.parametrize(
    "key",
    [
        ".checkpoints/../../x",
        "/etc/passwd",
        ".checkpoints//x",
        ".checkpoints/./x",
        ".checkpoints\\..\\x",
        ".checkpoints/a\x00b",
        "../.checkpoints/x",
        ".checkpoints/x/..",
        "",
        ".checkpoints",
        "other-root/x",
        ".checkpoints/" + "a" * 1100,
    ],
)
def test_hostile_keys_refused(key):
    with pytest.raises(UnsafeKey):
        split_key(key, ROOTS)


def test_plain_keys_map_into_their_root():
    root, parts = split_key(".checkpoints/alice/resp_1/3f.json", ROOTS)
    assert root.path == "/w/.checkpoints" and parts == ["alice", "resp_1", "3f.json"]
    root, parts = split_key(".function_approvals/approval_requests.json", ROOTS)
    assert root.name == ".function_approvals"


def test_odd_but_safe_names_pass():
    assert validate_relpath("a b/ünïcødé/..x/x..") == ["a b", "ünïcødé", "..x", "x.."]


def test_locate():
    roots = list(ROOTS.values())
    assert locate("/w/.checkpoints/a/b.json", roots) == (ROOTS[".checkpoints"], "a/b.json")
    assert locate("/w/.checkpoints", roots) == (ROOTS[".checkpoints"], "")
    assert locate("/w/.checkpoints-other/x", roots) is None
    assert locate("/elsewhere", roots) is None


def test_make_roots_resolves_and_refuses_clashes():
    roots = make_roots([".checkpoints", "/abs/.function_approvals"], "/work")
    assert [r.path for r in roots] == ["/work/.checkpoints", "/abs/.function_approvals"]
    with pytest.raises(ValueError, match="share the name"):
        make_roots(["a/.checkpoints", "b/.checkpoints"], "/w")
    with pytest.raises(ValueError, match="inside root"):
        make_roots(["/a", "/a/b"], "/w")
    with pytest.raises(ValueError, match="reserved"):
        make_roots([".sidecar-meta"], "/w")


def test_ignore_rules_match_the_writers_temp_files():
    ig = IgnoreRules()
    assert ig.ignored("ctx/3f2a.json.tmp")  # FileCheckpointStorage
    assert ig.ignored("alice/.approvals-abc123.tmp")  # mkstemp in the approvals store
    assert ig.ignored("state_stores/.Y2hlY2s.0b1c.tmp")  # agentserver state stores
    assert ig.ignored("ctx/.sidecar-restore-00ff")  # our own
    assert not ig.ignored("ctx/3f2a.json")
    assert not ig.ignored("approval_requests.json")


def test_our_own_files_are_ignored_whatever_the_configured_patterns():
    ig = IgnoreRules(["*.swp"])  # --ignore replaces the defaults...
    assert ig.ignored("a.swp") and not ig.ignored("a.json")
    assert ig.ignored("ctx/.sidecar-restore-00ff")  # ...never our restore temp files
    assert ig.ignored(".sidecar-restoring")  # ...nor the restore marker
    assert not IgnoreRules([]).ignored("x.tmp")


@pytest.mark.parametrize("key", [".checkpoints/.sidecar/owner", ".checkpoints/s/.sidecar-meta/x.json",
                                 ".checkpoints/a/b/.sidecar/owner"])
def test_a_component_named_like_the_stores_own_records_is_refused(key, tmp_path):
    """A root named like a nested namespace must never restore, upload or delete its records."""
    from sidecar.localfs import scan_root
    from sidecar.paths import make_key

    with pytest.raises(UnsafeKey):
        split_key(key, ROOTS)
    root = Root(".checkpoints", str(tmp_path / ".checkpoints"))
    with pytest.raises(UnsafeKey):
        make_key(root, key.split("/", 1)[1])
    target = tmp_path / key
    target.parent.mkdir(parents=True)
    target.write_bytes(b"x")
    (tmp_path / ".checkpoints" / "plain.json").write_bytes(b"y")
    assert set(scan_root(root, IgnoreRules())[0]) == {".checkpoints/plain.json"}
    assert split_key(".checkpoints/sidecar/.sidecarx/owner", ROOTS)[1] == ["sidecar", ".sidecarx", "owner"]


def test_make_roots_refuses_one_directory_under_two_names(tmp_path):
    """``SIDECAR_ROOTS=data,alias`` with ``alias -> data`` was mirrored twice (outside tester,
    round 2), as ``data,./data`` is refused; so is a link into another root."""
    (tmp_path / "data" / "inner").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(tmp_path / "data")
    (tmp_path / "into").symlink_to(tmp_path / "data" / "inner")
    with pytest.raises(ValueError, match="is the same directory as root .* through a symbolic link"):
        make_roots(["data", "alias"], str(tmp_path))
    with pytest.raises(ValueError, match="lies inside root .* through a symbolic link"):
        make_roots(["data", "into"], str(tmp_path))
    assert [r.name for r in make_roots(["data", "other"], str(tmp_path))] == ["data", "other"]


def test_a_listing_that_fails_part_way_is_a_gap_not_a_crash(tmp_path, monkeypatch):
    """A directory whose listing raises after its first entries (``SIDECAR_ROOTS=/proc``:
    ``/proc/1/map_files``; an I/O error): unreadable, said as a gap (outside tester, round 2: an
    unexpected ExceptionGroup stopped the sidecar and its host)."""
    import os

    from sidecar.localfs import Gaps, scan_root

    (tmp_path / "r" / "bad").mkdir(parents=True)
    (tmp_path / "r" / "bad" / "a.json").write_bytes(b"a")
    (tmp_path / "r" / "ok.json").write_bytes(b"ok")
    real = os.scandir

    class Failing:
        def __init__(self, path):
            self.it = real(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.it.close()

        def __iter__(self):
            yield from []
            raise PermissionError(13, "Permission denied", str(tmp_path / "r" / "bad"))

    monkeypatch.setattr(os, "scandir", lambda p: Failing(p) if str(p).endswith("/bad") else real(p))
    gaps = Gaps()
    files, _ = scan_root(Root("r", str(tmp_path / "r")), IgnoreRules(), gaps)
    assert list(files) == ["r/ok.json"]
    assert gaps.unreadable == {"r/bad": "Permission denied"}
