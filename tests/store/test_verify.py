"""``checkpoint-sidecar verify`` on both stores, in process (its async core over real stores): a
clean store is ok; a flipped byte in an object and in a restore point's entry is found with
``--read-data`` (and not without: their metadata is sound), naming the point that recovers the
object; a chain missing an increment and an incremental whose full point is gone are reported; a
damaged nested namespace does not taint its parent; an object whose metadata is gone and a point
cut short are damaged without reading data; so are a version lowered in an object's metadata and
a point entry that is no safe path; a missing store is one line, exit 1, and so is a prefix
holding no namespace (nothing was verified); nothing is written to the store. Bytes are
flipped through the store's own put (the old sha256 and version recorded over other bytes), so
the same rot is made on every backend."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from pointkit import write_point

from sidecar.config import load
from sidecar.errors import EXIT_FAIL, EXIT_OK
from sidecar.marker import OWNER_KEY
from sidecar.ops import verify
from sidecar.ops.namespaces import full_name
from sidecar.ops.verifyplan import NO_SHA256, OBJECT, POINT, Report
from sidecar.points.format import point_key
from sidecar.store import registry
from sidecar.store.base import ObjectMeta
from tests.memstore import MemorySpace

pytestmark = pytest.mark.anyio

PREFIX = "agents"
A, B, C = ".checkpoints/r1/a.json", ".checkpoints/r1/b.json", ".function_approvals/c.json"
V1 = 5 << 40  # versions a sidecar of generation 5 writes


async def put(store: Any, key: str, data: bytes, version: int) -> None:
    await store.put(key, data, ObjectMeta.of(data, 1_700_000_000_000_000_000, 0o644, version))


async def seed(store: Any, tag: str) -> None:
    """A namespace as a sidecar leaves it: three files, a marker, a full point (seq 10) of them all,
    then B rewritten and an incremental point (seq 12) of it."""
    marker = json.dumps({"generation": V1, "owner": "x" * 32, "heartbeat": 0, "identity": {}}).encode()
    await store.put(OWNER_KEY, marker, ObjectMeta.of(marker, V1, 0o600, version=V1))
    await put(store, A, f"{tag} a ".encode() * 300, V1 + 1)
    await put(store, B, f"{tag} b ".encode() * 300, V1 + 2)
    await put(store, C, f"{tag} c".encode(), V1 + 3)
    await write_point(store, V1 + 10, [A, B, C])
    await put(store, B, f"{tag} b, rewritten ".encode() * 200, V1 + 11)
    await write_point(store, V1 + 12, [B], base=V1 + 10, prev=V1 + 10)


async def flip(store: Any, key: str, at: int) -> None:
    """Rot: one byte of ``key`` flipped, its recorded metadata (sha256, version) left as it was."""
    data, info = await store.get(key)
    rotten = bytearray(data)
    rotten[at] ^= 0x20
    assert info.sha256 is not None
    await store.put(key, bytes(rotten), ObjectMeta(info.size, info.sha256, info.mtime_ns, info.mode, info.version))


def member_offset(blob: bytes, key: str) -> int:
    """Where a point member's bytes begin: after its 512-byte tar header (found by its name)."""
    return blob.index(key.encode() + b"\0") + 512


@pytest.fixture
async def place(store_place, make_store):
    """Two namespaces below ``agents``; returns a function that runs verify over them."""
    url, env = store_place
    for ns in ("s1", "s2"):
        await seed(await make_store(f"{PREFIX}/{ns}"), ns)

    def read_only(prefix: str) -> Any:
        if isinstance(url, MemorySpace):
            return url.store(prefix, create=False)
        return registry.make_store(url, prefix, read_only=True, env=env)

    async def run(read_data: bool, prefix: str = PREFIX) -> dict[str, Report]:
        top = read_only(prefix)
        try:
            await top.open()
            return {r.namespace: r async for r in verify.reports(
                top, lambda ns: read_only(full_name(prefix, ns)), read_data)}
        finally:
            await top.aclose()

    return run


def damaged(report: Report) -> dict[str, tuple[str, list[str], int | None]]:
    return {d.key: (d.kind, d.problems, d.recovered_by.seq if d.recovered_by else None) for d in report.damaged}


async def test_a_clean_store_is_ok_with_and_without_reading_data(place):
    for read_data in (False, True):
        reports = await place(read_data)
        assert set(reports) == {"s1", "s2"}
        for r in reports.values():
            assert r.ok, r.damaged
            assert (r.objects, r.points, r.read_data, r.gone) == (4, 2, read_data, 0)
            assert r.bytes > 0


async def test_a_flipped_byte_in_an_object_is_found_by_reading_data_and_named_with_its_point(place, make_store):
    s1 = await make_store(f"{PREFIX}/s1")
    await flip(s1, A, 7)
    await flip(s1, B, 0)  # the incremental holds B at this version
    assert all(r.ok for r in (await place(False)).values()), "their metadata is sound: nothing to see without the data"

    reports = await place(True)
    assert reports["s2"].ok
    assert damaged(reports["s1"]) == {
        A: (OBJECT, ["its bytes do not hash to its recorded sha256"], V1 + 10),  # the full point
        B: (OBJECT, ["its bytes do not hash to its recorded sha256"], V1 + 12),  # the newest: the incremental
    }
    recovered = {d.key: d for d in reports["s1"].damaged}
    assert recovered[A].recovered_at is not None  # the point's store time, for restore --as-of
    lines = verify.as_text(reports["s1"], PREFIX)
    assert lines[0].startswith("damaged  agents/s1 (4 objects, 2 restore points, ")
    assert f"  object {A}: its bytes do not hash to its recorded sha256; recoverable from restore point {V1 + 10} (" \
        in lines[1]
    out = verify.as_json(reports["s1"], PREFIX)
    assert out["status"] == "damaged" and out["namespace"] == "agents/s1"
    assert out["damaged"][0]["recovered_by"]["point"] == point_key("full", V1 + 10, V1 + 10)


async def test_a_flipped_byte_in_a_point_entry_is_found_and_that_point_recovers_nothing(place, make_store):
    s2 = await make_store(f"{PREFIX}/s2")
    incr = point_key("incr", V1 + 12, V1 + 10)
    blob, _ = await s2.get(incr)
    await flip(s2, incr, member_offset(blob, B) + 3)
    assert all(r.ok for r in (await place(False)).values()), "the header is intact: only the data tells"

    await flip(s2, B, 1)  # and B itself: only the broken incremental held this version
    reports = await place(True)
    assert reports["s1"].ok
    assert damaged(reports["s2"]) == {
        B: (OBJECT, ["its bytes do not hash to its recorded sha256"], None),
        incr: (POINT, ["its bytes do not hash to its recorded sha256",
                       f"entry {B!r} does not match its sha256"], None),
    }
    assert verify.as_text(reports["s2"], PREFIX)[1].endswith("; no restore point recovers it")


async def test_every_bad_entry_of_a_point_is_named(place, make_store):
    s1 = await make_store(f"{PREFIX}/s1")
    full = point_key("full", V1 + 10, V1 + 10)
    blob, _ = await s1.get(full)
    await flip(s1, full, member_offset(blob, A))
    blob, _ = await s1.get(full)
    await flip(s1, full, member_offset(blob, C))
    (point,) = (await place(True))["s1"].damaged
    assert point.key == full and point.problems[1:] == [f"entry {A!r} does not match its sha256",
                                                        f"entry {C!r} does not match its sha256"]


async def test_a_chain_missing_an_increment_is_reported(place, make_store):
    s1 = await make_store(f"{PREFIX}/s1")
    await put(s1, C, b"c again", V1 + 20)
    await write_point(s1, V1 + 21, [C], base=V1 + 10, prev=V1 + 12)
    await put(s1, C, b"c once more", V1 + 22)
    await write_point(s1, V1 + 23, [C], base=V1 + 10, prev=V1 + 21)
    await s1.delete(point_key("incr", V1 + 21, V1 + 10))
    await flip(s1, C, 0)  # held at its version only by the point after the gap
    for read_data in (False, True):
        report = (await place(read_data))["s1"]
        after_gap = point_key("incr", V1 + 23, V1 + 10)
        problems = damaged(report)
        assert problems[after_gap] == (POINT, [f"it follows point {V1 + 21}, which its chain lacks (the chain of full "
                                               f"point {V1 + 10} is incomplete)"], None)
        if read_data:
            assert problems[C] == (OBJECT, ["its bytes do not hash to its recorded sha256"], None)
        assert set(problems) <= {after_gap, C}


async def test_an_increment_whose_full_point_is_gone_is_reported(place, make_store):
    s2 = await make_store(f"{PREFIX}/s2")
    await s2.delete(point_key("full", V1 + 10, V1 + 10))
    report = (await place(False))["s2"]
    assert damaged(report) == {point_key("incr", V1 + 12, V1 + 10): (POINT, [f"its full point {V1 + 10} is gone"], None)}


async def drop_metadata(store_place, key: str) -> None:
    """The sidecar's metadata of ``key`` gone: the directory store's record removed, the blob's
    metadata cleared (as a blob another tool wrote carries none)."""
    url, env = store_place
    if not url.startswith("http"):
        os.unlink(os.path.join(url, PREFIX, "s1", ".sidecar-meta", key + ".json"))
        return
    from azure.storage.blob.aio import BlobServiceClient

    container = url.rstrip("/").rsplit("/", 1)[1]
    async with BlobServiceClient.from_connection_string(env["AZURE_STORAGE_CONNECTION_STRING"]) as svc:
        await svc.get_blob_client(container, f"{PREFIX}/s1/{key}").set_blob_metadata({})


async def test_an_object_without_metadata_and_a_cut_short_point(place, make_store, store_place):
    s1 = await make_store(f"{PREFIX}/s1")
    await drop_metadata(store_place, A)
    full = point_key("full", V1 + 10, V1 + 10)
    blob, info = await s1.get(full)
    await s1.put(full, blob[:2048], ObjectMeta.of(blob[:2048], info.mtime_ns, info.mode, info.version))
    problems = damaged((await place(False))["s1"])
    assert problems[A] == (OBJECT, [NO_SHA256], None)
    kind, why, _ = problems[full]
    assert kind == POINT and why[0].startswith("unreadable point: cut short")
    # the incremental's chain is broken at its full point: it recovers nothing either
    assert point_key("incr", V1 + 12, V1 + 10) not in problems


async def test_a_nested_namespace_is_verified_on_its_own(place, make_store):
    await seed(await make_store(PREFIX), "top")  # the prefix itself is a namespace around s1 and s2
    s2 = await make_store(f"{PREFIX}/s2")
    await flip(s2, A, 2)
    reports = await place(True)
    assert list(reports)[-1] == "" and set(reports) == {"s1", "s2", ""}, "children before the namespace around them"
    assert reports[""].ok and reports[""].objects == 4, "the nested namespaces' keys are theirs"
    assert set(damaged(reports["s2"])) == {A}


async def test_verify_writes_nothing(place, make_store, store_place):
    """Not an object, and on a directory store not a record, lock or temp file either (a directory's
    mtime changes when anything is made in it and removed: no clock's temp file either)."""
    s1 = await make_store(f"{PREFIX}/s1")
    await flip(s1, A, 7)
    before = await everything(make_store), tree(store_place[0])
    await place(True)
    await place(False)
    assert (await everything(make_store), tree(store_place[0])) == before


async def everything(make_store) -> dict[str, tuple]:
    store = await make_store("")
    return {i.key: (i.size, i.sha256, i.version, i.modified) async for i in store.list()}


def tree(url: str) -> dict[str, tuple[int, int]] | None:
    """Every path below a directory store with its mtime and size (None for Azure)."""
    if url.startswith("http"):
        return None
    out = {}
    for top, dirs, files in os.walk(url):
        for name in dirs + files:
            st = os.lstat(os.path.join(top, name))
            out[os.path.join(top, name)] = (st.st_mtime_ns, st.st_size)
    return out


async def test_the_command_on_a_missing_store_is_one_line_exit_1(store_place, monkeypatch, capsys):
    url, env = store_place
    missing = url + "-missing"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings, _roots = load({"store": missing, "prefix": PREFIX})
    assert await verify.command(settings, True, False) == EXIT_FAIL
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "is not there" in err, err


async def test_the_command_exit_codes_and_output(place, make_store, store_place, monkeypatch, capsys):
    url, env = store_place
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings, _roots = load({"store": url, "prefix": PREFIX})
    assert await verify.command(settings, True, True) == EXIT_OK
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert sorted((r["namespace"], r["status"]) for r in rows) == [("agents/s1", "ok"), ("agents/s2", "ok")]

    await flip(await make_store(f"{PREFIX}/s1"), A, 7)
    assert await verify.command(settings, False, False) == EXIT_OK
    assert await verify.command(settings, True, False) == verify.EXIT_DAMAGED
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "verify: 2 namespaces, 1 ok, 1 damaged (every byte read)"
    assert any(line.startswith(f"  object {A}: ") for line in out)


async def test_names_are_escaped_in_the_text_report(place, make_store):
    s1 = await make_store(f"{PREFIX}/s1")
    evil = ".checkpoints/r1/x\u202egnp.json\u2028ok       forged.json"  # bidi override, line separator
    await put(s1, evil, b"evil", V1 + 30)
    await flip(s1, evil, 0)
    lines = verify.as_text((await place(True))["s1"], PREFIX)
    assert len(lines) == 2 and "\u202e" not in lines[1] and "\u2028" not in lines[1]
    assert "x\\u202egnp.json\\u2028ok" in lines[1]


async def test_a_prefix_with_no_namespace_says_nothing_was_verified(place, store_place, monkeypatch, capsys):
    url, env = store_place
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings, _roots = load({"store": url, "prefix": "agnets"})  # a typo: the store is there, the prefix is empty
    # exit 1 like a store that is not there (issue #34, item 6): nothing verified is no sound store
    assert await verify.command(settings, False, False) == EXIT_FAIL
    out, err = capsys.readouterr()
    assert out == ""
    [line] = err.splitlines()
    assert "no namespace below the prefix 'agnets'" in line and "nothing was verified" in line


async def test_a_version_lowered_in_an_objects_metadata_is_found_without_reading_data(place, make_store):
    """Issue #34, item 6: a version field edited by hand (or one the store cannot parse, taken for
    0) passed a metadata check. A point records each key's version as written, and a put never
    lowers it: the object is damaged, and that point recovers it."""
    s1 = await make_store(f"{PREFIX}/s1")
    for version in (V1, 0):
        data, _ = await s1.get(A)
        await s1.delete(A)  # its metadata rewritten: the same bytes at a lower version
        await put(s1, A, data, version)
        problems = damaged((await place(False))["s1"])
        assert problems == {A: (OBJECT, [f"its recorded version {version} is below the version {V1 + 1} restore "
                                         f"point {V1 + 10} records for it: a put never lowers a version, so its "
                                         "metadata was changed"], V1 + 10)}, problems


async def test_a_point_entry_that_is_no_safe_path_is_damage(place, make_store):
    """Issue #34, item 6: a point whose entries climb out of their root (``../``) passed verify,
    though a restore refuses them."""
    from sidecar.points.format import FULL, PointEntry, PointHeader, encode_point

    s1 = await make_store(f"{PREFIX}/s1")
    seq = V1 + 40
    evil = {".checkpoints/../../etc/cron.d/x": b"* * * * * root sh", ".checkpoints/r1/ok.json": b"fine"}
    entries = tuple(PointEntry(k, ObjectMeta.of(v, 1, 0o644, V1 + 39)) for k, v in evil.items())
    key = point_key(FULL, seq, seq)
    blob = encode_point(PointHeader(FULL, seq, seq, seq, entries), evil)
    await s1.put(key, blob, ObjectMeta.of(blob, 1, 0o600, seq))
    for read_data in (False, True):
        problems = damaged((await place(read_data))["s1"])
        assert list(problems) == [key], problems
        kind, why, _ = problems[key]
        assert kind == POINT and len(why) == 1, why
        assert why[0].startswith("entry '.checkpoints/../../etc/cron.d/x' is no safe path (") and \
            why[0].endswith("): a restore refuses it"), why
