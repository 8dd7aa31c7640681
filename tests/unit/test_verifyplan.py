"""The pure rules of ``verify``: object metadata, keys that are another namespace's, damaged points
and broken chains, and which point recovers a damaged object."""

from __future__ import annotations

from sidecar.ops.verifyplan import (
    NO_SHA256,
    PointCheck,
    elsewhere,
    entry_conflict,
    metadata_problems,
    point_problems,
    recovering_point,
    sound_points,
)
from sidecar.points.format import FULL, INCR, PointEntry, PointName
from sidecar.store.base import ObjectInfo, ObjectMeta

SHA = "ab" * 32


def info(key: str = "r/a", sha256: str | None = SHA, version: int = 7, size: int = 3) -> ObjectInfo:
    return ObjectInfo(key, size, sha256, 1, 0o600, None, version, 100.0)


def full(seq: int) -> PointName:
    return PointName(seq, FULL, seq)


def incr(seq: int, base: int) -> PointName:
    return PointName(seq, INCR, base)


def test_metadata_problems():
    assert metadata_problems(info()) == []
    assert metadata_problems(info(version=0)) == [], "written by an older release: no version, still sound"
    assert metadata_problems(info(sha256=None)) == [NO_SHA256]
    assert metadata_problems(info(sha256="AB" * 32)) == ["its recorded sha256 is malformed"]
    assert metadata_problems(info(version=1 << 63)) == [
        f"its recorded version {1 << 63} is out of the range a sidecar writes"]


def test_keys_of_nested_namespaces_and_records_are_elsewhere():
    nested = {"s1", "deep/s2"}.__contains__
    assert not elsewhere(".checkpoints/a.json", nested)
    assert not elsewhere("s1", nested), "a file named like a namespace is this namespace's"
    assert elsewhere("s1/.checkpoints/a.json", nested) and elsewhere("deep/s2/.sidecar/owner", nested)
    assert not elsewhere("deep/x.json", nested)
    assert elsewhere("x/.sidecar-meta/a.json", nested)


def test_an_entry_conflicts_only_with_the_object_of_its_own_version():
    same = PointEntry("r/a", ObjectMeta(3, SHA, 1, 0o600, 7))
    assert not entry_conflict(info(), same)
    assert entry_conflict(info(size=4), same) and entry_conflict(info(sha256="cd" * 32), same)
    assert not entry_conflict(info(sha256="cd" * 32, version=8), same), "another write of the key"
    assert not entry_conflict(info(sha256="cd" * 32, version=0), PointEntry("r/a", ObjectMeta(3, SHA, 1, 0o600, 0)))
    assert not entry_conflict(None, same) and not entry_conflict(info(sha256=None, size=9), same)
    assert not entry_conflict(info(), PointEntry("r/a", None))


def checks(*specs: tuple[PointName, dict]) -> dict[PointName, PointCheck]:
    out = {}
    for name, kw in specs:
        kw = dict(kw)
        out[name] = PointCheck(name, info(name.key, kw.pop("sha256", SHA)), **kw)
    return out


def test_a_sound_chain_has_no_problems_and_every_point_recovers():
    c = checks((full(10), {"prev": 10, "holds": {"r/a"}}), (incr(12, 10), {"prev": 10}),
               (incr(13, 10), {"prev": 12, "holds": {"r/a"}}))
    problems = point_problems(c)
    assert problems == {}
    assert sound_points(c, problems) == set(c)
    assert recovering_point("r/a", c, sound_points(c, problems)) == incr(13, 10)
    assert recovering_point("r/b", c, sound_points(c, problems)) is None


def test_a_missing_increment_breaks_the_chain_from_the_point_after_it():
    c = checks((full(10), {"prev": 10, "holds": {"r/a"}}), (incr(12, 10), {"prev": 10}),
               (incr(14, 10), {"prev": 13, "holds": {"r/a"}}), (incr(15, 10), {"prev": 14}))
    problems = point_problems(c)
    assert problems == {incr(14, 10): ["it follows point 13, which its chain lacks (the chain of full point 10 is "
                                       "incomplete)"]}
    assert sound_points(c, problems) == {full(10), incr(12, 10)}
    assert recovering_point("r/a", c, sound_points(c, problems)) == full(10)


def test_damaged_unreadable_gone_and_orphaned_points():
    c = checks((full(10), {"prev": 10}), (incr(11, 10), {"prev": 10, "bad_entries": ["r/a", "r/b"]}),
               (full(20), {"error": "unreadable point: cut short"}), (incr(21, 20), {"prev": 20, "holds": {"r/a"}}),
               (full(30), {"gone": True}), (incr(31, 30), {"prev": 30, "holds": {"r/a"}}),
               (incr(41, 40), {"prev": 40}), (full(50), {"prev": 50, "sha256": None}))
    problems = point_problems(c)
    assert problems == {
        incr(11, 10): ["entry 'r/a' does not match its sha256", "entry 'r/b' does not match its sha256"],
        full(20): ["unreadable point: cut short"],
        incr(41, 40): ["its full point 40 is gone"],
        full(50): [NO_SHA256],
    }
    assert sound_points(c, problems) == {full(10)}, "a chain is only as good as every point up to the one restored"
    assert recovering_point("r/a", c, sound_points(c, problems)) is None
