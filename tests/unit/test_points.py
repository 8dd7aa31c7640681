"""Restore points: names, header, the streamed format (read back by tar too), and the pure plans."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import anyio
import pytest

from sidecar.localfs import Unstable
from sidecar.points.format import (
    FULL,
    INCR,
    MAX_POINT_ENTRIES,
    POINT_MANIFEST,
    EntryMismatch,
    PointEntry,
    PointError,
    PointHeader,
    PointName,
    PointReader,
    encode_header,
    encode_point,
    fits,
    parse_header,
    parse_point_key,
    point_chunks,
    point_key,
    point_source,
    read_point,
)
from sidecar.points.plan import (
    Chain,
    Retention,
    chains,
    choose_as_of,
    choose_for_latest,
    full_due,
    link_error,
    retention_now,
    retention_plan,
)
from sidecar.store.base import CHUNK_BYTES, ObjectMeta
from sidecar.tarstream import drain

H = 3600.0
D = 86400.0


def full(seq: int) -> PointName:
    return PointName(seq, FULL, seq)


def incr(seq: int, base: int) -> PointName:
    return PointName(seq, INCR, base)


def meta(data: bytes, version: int = 7) -> ObjectMeta:
    return ObjectMeta(len(data), hashlib.sha256(data).hexdigest(), 1_700_000_000_123_456_789, 0o640, version)


def header(kind: str, seq: int, base: int, prev: int, files: dict[str, bytes], deleted: tuple[str, ...] = ()) -> PointHeader:
    entries = [PointEntry(k, meta(v)) for k, v in files.items()] + [PointEntry(k, None) for k in deleted]
    return PointHeader(kind, seq, base, prev, tuple(entries))


async def _chunks(blob: bytes, piece: int):
    for i in range(0, len(blob), piece):
        yield blob[i : i + piece]


def read(blob: bytes, piece: int = 4096) -> tuple[PointHeader, dict[str, bytes]]:
    return anyio.run(read_point, _chunks(blob, piece))


# -- names ------------------------------------------------------------------------------------
def test_keys_are_zero_padded_and_parse_back():
    assert point_key(FULL, 5, 5) == ".sidecar/points/0000000000000000005-full.tar"
    assert point_key(INCR, 12, 5) == ".sidecar/points/0000000000000000012-incr-0000000000000000005.tar"
    assert parse_point_key(point_key(FULL, 5, 5)) == full(5)
    n = parse_point_key(point_key(INCR, 12, 5))
    assert n == incr(12, 5) and (n.kind, n.base) == (INCR, 5) and n.key == point_key(INCR, 12, 5)
    assert sorted([point_key(FULL, 100, 100), point_key(FULL, 9, 9)]) == [point_key(FULL, 9, 9), point_key(FULL, 100, 100)]


@pytest.mark.parametrize("key", [
    ".sidecar/points/5-full.tar", ".sidecar/points/0000000000000000005-full.tar.tmp", "r/0000000000000000005-full.tar",
    ".sidecar/points/0000000000000000005-incr-0000000000000000005.tar",  # its own base
    ".sidecar/points/0000000000000000005-incr-0000000000000000009.tar",  # base after it
    ".sidecar/points/0000000000000000005-diff.tar", ".sidecar/points/", ".sidecar/points/x/0000000000000000005-full.tar",
])
def test_other_keys_are_no_points(key):
    assert parse_point_key(key) is None


def test_impossible_names_are_refused():
    for args in ((FULL, 5, 4), (INCR, 5, 5), (INCR, 5, 6), ("diff", 5, 5), (FULL, 10**19, 10**19)):
        with pytest.raises(ValueError):
            point_key(*args)


# -- format -----------------------------------------------------------------------------------
def test_a_point_round_trips_in_any_chunking_and_is_a_tar_archive():
    files = {"r/a": b"A" * 10, "r/sub/b": bytes(range(256)) * 40, "r/empty": b"", "r/" + "n" * 200: b"long name"}
    h = header(INCR, 20, 10, 15, files, deleted=("r/gone",))
    blob = encode_point(h, files)
    for piece in (1, 7, 512, 4096, len(blob)):
        got_h, got = read(blob, piece)
        assert got_h == h and got == files
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:  # what docs/RESTORE.md says to do by hand
        names = tar.getnames()
        assert names[0] == POINT_MANIFEST and names[1:] == list(files)
        assert json.loads(tar.extractfile(POINT_MANIFEST).read())["entries"][-1] == {"key": "r/gone", "deleted": True}
        assert tar.extractfile("r/sub/b").read() == files["r/sub/b"]
        assert tar.getmember("r/a").mode == 0o640


def test_the_header_says_the_contracts_fields():
    h = header(FULL, 9, 9, 9, {"r/a": b"x"})
    raw = json.loads(encode_header(h))
    assert raw == {"format": "checkpoint-sidecar-point", "version": 1, "kind": "full", "seq": 9, "base": 9, "prev": 9,
                   "entries": [{"key": "r/a", "size": 1, "sha256": hashlib.sha256(b"x").hexdigest(),
                                "mtime_ns": 1_700_000_000_123_456_789, "mode": 0o640, "version": 7}]}
    assert parse_header(encode_header(h)) == h
    assert h.matches(full(9)) and not h.matches(incr(9, 3)) and h.name == full(9)


def test_a_large_file_streams_in_bounded_chunks():
    big = b"z" * (2 * CHUNK_BYTES + 3)
    h = header(FULL, 1, 1, 1, {"r/big": big})
    assert max(len(c) for c in point_chunks(h, {"r/big": big})) <= CHUNK_BYTES

    async def sizes():
        reader = PointReader(_chunks(encode_point(h, {"r/big": big}), CHUNK_BYTES))
        await reader.header()
        out = []
        async for _, body in reader.files():
            out += [len(c) async for c in body]
        return out

    got = anyio.run(sizes)
    assert sum(got) == len(big) and max(got) <= CHUNK_BYTES


def test_a_source_gives_the_bytes_it_measured_and_refuses_a_changed_file():
    class Disk:
        def __init__(self, data: bytes) -> None:
            self.data = data

        def iter_sync(self):
            yield self.data

    disk = Disk(b"hello")
    h = header(FULL, 3, 3, 3, {"r/a": b"hello"})
    src = point_source(h, {"r/a": disk})
    blob = b"".join(src.iter_sync())
    assert src.size == len(blob) and src.sha256 == hashlib.sha256(blob).hexdigest()
    assert read(blob)[1] == {"r/a": b"hello"}
    disk.data = b"hello, longer"
    with pytest.raises(Unstable):
        b"".join(src.iter_sync())


def _corrupt(blob: bytes, needle: bytes, repl: bytes) -> bytes:
    i = blob.rindex(needle)
    return blob[:i] + repl + blob[i + len(repl) :]


def test_a_member_whose_bytes_do_not_match_is_refused_while_streaming():
    files = {"r/a": b"a" * 600, "r/b": b"b" * 600}
    blob = _corrupt(encode_point(header(FULL, 1, 1, 1, files), files), b"b" * 600, b"B")
    with pytest.raises(PointError, match="'r/b' does not match its sha256"):
        read(blob)

    async def first_only():  # the first member was given whole before the bad one was seen
        reader = PointReader(_chunks(blob, 512))
        seen = []
        with pytest.raises(PointError):
            async for e, body in reader.files():
                seen.append((e.key, b"".join([c async for c in body])))
        return seen

    assert anyio.run(first_only) == [("r/a", files["r/a"])]


def test_a_reader_reads_on_past_members_whose_bytes_do_not_match():
    """The mismatch is raised once the member's padding is read too: a caller that catches it
    (verify, naming every bad member) reads the next member, and the archive's end is checked."""
    files = {"r/a": b"a" * 600, "r/b": b"b" * 7, "r/c": b"c" * 5000}
    blob = encode_point(header(FULL, 1, 1, 1, files), files)
    blob = _corrupt(_corrupt(blob, b"a" * 600, b"A"), b"c" * 5000, b"C")

    async def every(piece: int) -> list[tuple[str, str]]:
        out = []
        async for e, body in PointReader(_chunks(blob, piece)).files():
            try:
                await drain(body)
                out.append((e.key, "ok"))
            except EntryMismatch as err:
                out.append((e.key, str(err)))
        return out

    for piece in (1, 512, 4096, len(blob)):
        assert anyio.run(every, piece) == [("r/a", "point 1 entry 'r/a' does not match its sha256"), ("r/b", "ok"),
                                           ("r/c", "point 1 entry 'r/c' does not match its sha256")]


def test_a_chain_link_names_the_point_it_lacks():
    assert link_error(5, None) is None and link_error(5, incr(5, 1)) is None
    assert link_error(4, incr(5, 1)) == "it follows point 4, which its chain lacks"


@pytest.mark.parametrize("cut", [0, 100, 512, 1500, -1024, -1])
def test_a_point_cut_short_is_refused(cut):
    files = {"r/a": b"a" * 700}
    blob = encode_point(header(FULL, 1, 1, 1, files), files)
    with pytest.raises(PointError):
        read(blob[:cut])


def test_bytes_beyond_the_entries_and_misplaced_members_are_refused():
    files = {"r/a": b"a", "r/b": b"b"}
    blob = encode_point(header(FULL, 1, 1, 1, files), files)
    with pytest.raises(PointError, match="beyond"):
        read(blob[:-1024] + b"\x01" + bytes(1023))
    swapped = encode_point(header(FULL, 1, 1, 1, {"r/b": b"b", "r/a": b"a"}), files)
    h = encode_header(header(FULL, 1, 1, 1, files))
    other = encode_header(header(FULL, 1, 1, 1, {"r/b": b"b", "r/a": b"a"}))
    with pytest.raises(PointError, match="not where its header says"):
        read(swapped.replace(other, h))


@pytest.mark.parametrize("mutate", [
    lambda h: {**h, "format": "x"}, lambda h: {**h, "version": 2}, lambda h: {**h, "kind": "diff"},
    lambda h: {**h, "seq": -1}, lambda h: {**h, "prev": 99}, lambda h: {**h, "seq": True},
    lambda h: {**h, "entries": [{"key": "r/a", "deleted": True}]},  # a full with a deletion
    lambda h: {**h, "entries": h["entries"] * 2},  # a key twice
    lambda h: {**h, "entries": [{**h["entries"][0], "sha256": "nothex"}]},
    lambda h: {**h, "entries": [{**h["entries"][0], "size": -1}]},
    lambda h: {k: v for k, v in h.items() if k != "prev"},
])
def test_malformed_headers_are_refused(mutate):
    raw = json.loads(encode_header(header(FULL, 4, 4, 4, {"r/a": b"x"})))
    with pytest.raises(PointError):
        parse_header(json.dumps(mutate(raw)).encode())
    with pytest.raises(PointError):
        parse_header(b"[1, 2")


def test_an_incremental_header_must_follow_within_its_chain():
    assert parse_header(encode_header(header(INCR, 9, 4, 4, {}))).prev == 4
    for base, prev in ((4, 9), (4, 3), (10, 10)):
        with pytest.raises(PointError):
            parse_header(encode_header(PointHeader(INCR, 9, base, prev, ())))


def test_a_header_that_does_not_match_its_name_is_refused():
    blob = encode_point(header(FULL, 4, 4, 4, {}), {})

    async def go(name):
        return await PointReader(_chunks(blob, 512)).header(name)

    assert anyio.run(go, full(4)).seq == 4
    with pytest.raises(PointError, match="another point"):
        anyio.run(go, full(5))


def test_headers_beyond_the_bounds_do_not_fit():
    assert fits(header(FULL, 1, 1, 1, {"r/a": b""}))
    many = PointHeader(FULL, 1, 1, 1, tuple(PointEntry(f"r/{i}", None) for i in range(MAX_POINT_ENTRIES + 1)))
    assert not fits(many)
    long_keys = PointHeader(FULL, 1, 1, 1, tuple(PointEntry(f"r/{i}/" + "k" * 1000, meta(b"")) for i in range(9000)))
    assert not fits(long_keys)


# -- plans ------------------------------------------------------------------------------------
def test_chains_group_incrementals_under_their_full_point():
    pts = [full(1), incr(2, 1), incr(3, 1), full(4), incr(5, 4), incr(7, 6)]  # 7: its full is gone
    assert chains(pts) == [Chain(full(1), (incr(2, 1), incr(3, 1))), Chain(full(4), (incr(5, 4),))]
    assert chains(reversed(pts))[0].upto(incr(2, 1)) == (full(1), incr(2, 1))
    assert chains([]) == []


def test_the_latest_is_the_newest_usable_chain_prefix():
    pts = [full(1), incr(2, 1), full(4), incr(5, 4), incr(6, 4), incr(9, 8)]
    assert choose_for_latest(pts) == (full(4), incr(5, 4), incr(6, 4))
    assert choose_for_latest(pts, unusable=[incr(6, 4)]) == (full(4), incr(5, 4))
    assert choose_for_latest(pts, unusable=[full(4)]) == (full(1), incr(2, 1))
    assert choose_for_latest([incr(9, 8)]) == ()


def test_as_of_takes_the_newest_point_at_or_before_the_time():
    times = {full(1): 100.0, incr(2, 1): 200.0, full(4): 300.0, incr(5, 4): 400.0, incr(6, 4): None}
    assert choose_as_of(times, 99.0) == ()
    assert choose_as_of(times, 100.0) == (full(1),)
    assert choose_as_of(times, 299.9) == (full(1), incr(2, 1))
    assert choose_as_of(list(times.items()), 10_000.0) == (full(4), incr(5, 4))
    assert choose_as_of(times, 450.0, unusable=[incr(5, 4)]) == (full(4),)


def test_retention_keeps_the_last_hour_one_an_hour_for_a_day_one_a_day_for_a_week():
    now = 100 * D
    times: dict[PointName, float] = {}
    for seq, minutes in enumerate(range(9 * 24 * 60, -1, -10), 1):  # a full point every 10 minutes, 9 days
        times[full(seq)] = now - minutes * 60.0
    kept = set(times) - set(plan := retention_plan(times, now))
    ages = sorted(now - times[p] for p in kept)
    assert [a for a in ages if a <= H] == [i * 600.0 for i in range(7)]  # every point of the last hour
    hours = {int(times[p] // H) for p in kept if H < now - times[p] <= D}
    assert len([p for p in kept if H < now - times[p] <= D]) == len(hours)  # one an hour
    assert len(hours) >= 23
    days = {int(times[p] // D) for p in kept if D < now - times[p] <= 7 * D}
    assert len(days) >= 6 and all(now - times[p] <= 7 * D for p in kept)
    assert plan == sorted(plan, reverse=True) and set(plan) | kept == set(times)


def test_retention_never_deletes_what_a_kept_point_needs_nor_the_newest():
    now = 30 * D
    times = {full(1): now - 20 * D, incr(2, 1): now - 19 * D, incr(3, 1): now - 3 * D, incr(4, 1): now - 3 * D + 10,
             full(5): now - 15 * D, incr(8, 6): now - 10 * D, PointName(9, INCR, 1): None}
    gone = retention_plan(times, now)
    # incr 4 is its day's newest: its chain back to full 1 stays; incr 3 too (4 needs it)
    assert gone == [incr(8, 6), full(5)]
    old = {full(1): now - 20 * D, incr(2, 1): now - 19 * D}
    assert retention_plan(old, now) == []  # the newest point (and its chain) is always kept
    assert retention_plan(old, now, Retention(keep_all=0, hourly=0, daily=0)) == []
    assert retention_plan({full(1): now - 2 * H, full(2): now - 1.5 * H}, now, Retention(hourly=0, daily=0)) == [full(1)]


def test_a_point_dated_ahead_does_not_age_the_recent_ones_out():
    """An older point whose store time is 10 days ahead (a store written while its clock ran
    ahead, or copied from one): now is the newest point's time, so the points of the last
    minutes stay, and the one dated ahead (its age unknown) too."""
    now = 100 * D
    times = {full(1): now + 10 * D, incr(2, 1): now - 50, full(3): now - 40, incr(4, 3): now - 20, incr(5, 3): now}
    assert retention_now(times) == now
    assert retention_plan(times, retention_now(times), Retention(keep_all=H)) == []
    assert retention_now({}) is None and retention_now({full(1): None}) is None


def test_retention_keeps_an_orphan_incremental_only_for_the_last_hour():
    now = 10 * D
    assert retention_plan({incr(9, 8): now - 60}, now) == []
    assert retention_plan({incr(9, 8): now - 2 * H, full(10): now}, now) == [incr(9, 8)]


def test_a_full_point_is_due_when_the_chain_costs_more_than_one():
    kw = dict(full_bytes=1000, incrs=5, full_age=60.0, full_interval=D, tree_bytes=1000)
    assert not full_due(incr_bytes=999, **kw)
    assert full_due(incr_bytes=1001, **kw)
    assert full_due(incr_bytes=0, **{**kw, "full_age": D})
    assert not full_due(incr_bytes=0, **{**kw, "full_age": 10 * D, "full_interval": 0})
    assert full_due(incr_bytes=0, **{**kw, "incrs": 2000})


def test_a_header_nested_past_the_parsers_depth_is_unreadable_not_a_crash():
    """``[[[…]]]`` a few thousand deep in a point's header (or a bundle's) raised RecursionError out
    of json.loads, which verify, history and restore reported as an unexpected error, exit 1."""
    from sidecar.points.format import PointError, parse_header
    from sidecar.snapshot import BundleError, _parse_header

    deep = b"[" * 5000 + b"]" * 5000
    with pytest.raises(PointError):
        parse_header(deep)
    with pytest.raises(BundleError):
        _parse_header(deep, 2)
