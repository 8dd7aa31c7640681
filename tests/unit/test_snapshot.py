import pytest

from sidecar.snapshot import BundleError, Change, decode_bundle, encode_bundle
from sidecar.store.base import ObjectMeta


def test_bundle_round_trip():
    a = b"\x00binary\n" * 100
    changes = [Change("r/a", a, ObjectMeta.of(a, 5, 0o640)), Change("r/gone", None, None),
               Change("r/empty", b"", ObjectMeta.of(b"", 6, 0o600))]
    root, back = decode_bundle(encode_bundle("r", changes))
    assert root == "r" and back == changes


def test_corrupt_bundle_refused():
    a = b"abc"
    blob = encode_bundle("r", [Change("r/a", a, ObjectMeta.of(a, 1, 0o600))])
    with pytest.raises(BundleError):
        decode_bundle(blob[:-1] + b"x")
    with pytest.raises(BundleError):
        decode_bundle(b"not json\n")


@pytest.mark.parametrize("blob", [
    b"[]\n",  # a header that is not an object
    b'{"version": 1, "root": "r", "entries": [[]]}\n',  # an entry that is not an object
    b'{"version": 1, "root": "r", "entries": [{"key": 5, "deleted": true}]}\n',  # a key that is not a string
    b'{"version": 1, "root": ["r"], "entries": []}\n',
    b'{"version": 1, "root": "r", "entries": {}}\n',
    b'{"version": 1, "root": "r", "entries": [{"key": "r/a", "size": -1, "sha256": "x", "mtime_ns": 1, "mode": 384}]}\nabc',
    b'{"version": 1, "root": "r", "entries": [{"key": "r/a", "size": 9, "sha256": "x", "mtime_ns": 1, "mode": 384}]}\nabc',
    b'{"version": 1, "root": "r", "entries": [{"key": "r/a", "size": true, "sha256": "x", "mtime_ns": 1, "mode": 384}]}\na',
    b'{"version": 1, "root": "r", "entries": [{"key": "r/a", "size": 1, "sha256": 7, "mtime_ns": 1, "mode": 384}]}\na',
    b'{"version": 1, "root": "r", "entries": []}\ntrailing bytes no entry accounts for',
    b'{"version": 2, "root": "r", "entries": []}\n',
])
def test_hostile_bundles_are_refused_as_unreadable(blob):
    """A bundle is read from the store: whatever it holds is a BundleError (one line at restore),
    never an AttributeError or a half-decoded change."""
    with pytest.raises(BundleError):
        decode_bundle(blob)


def test_take_all_ignores_barriers():
    from sidecar.queue import DELETE, UPLOAD, PendingSet

    ps = PendingSet()
    ps.mark("b", UPLOAD)
    ps.mark("a", DELETE)
    ops = ps.take_all()
    assert {(o.kind, o.key) for o in ops} == {(UPLOAD, "b"), (DELETE, "a")}
    assert ps.take() is None
    for o in ops:
        ps.done(o)
    assert ps.idle()


# -- this release's format (a tar archive), streamed --------------------------------------------

import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import tarfile  # noqa: E402

import anyio  # noqa: E402

from sidecar.snapshot import BundleReader, BundleSource, bundle_chunks  # noqa: E402

LONG = "r/" + "d" * 120 + "/ümlaut-" + "x" * 200 + ".json"  # beyond ustar's name field: a pax header


def _changes():
    a = b"\x00binary\n" * 1000
    big = bytes(range(256)) * 40_000  # several chunks of a streamed read
    return [Change("r/a", a, ObjectMeta.of(a, 5_000_000_123, 0o640)), Change("r/gone", None, None),
            Change("r/empty", b"", ObjectMeta.of(b"", 6, 0o600)), Change(LONG, big, ObjectMeta.of(big, -7, 0o600))]


def _v1(root, changes):
    """The previous release's encoder, verbatim: stores it wrote must still restore."""
    header = {"version": 1, "root": root, "entries": [
        {"key": c.key, "deleted": True} if c.data is None else
        {"key": c.key, "size": c.meta.size, "sha256": c.meta.sha256, "mtime_ns": c.meta.mtime_ns, "mode": c.meta.mode}
        for c in changes]}
    return json.dumps(header, separators=(",", ":")).encode() + b"\n" + b"".join(
        c.data for c in changes if c.data is not None)


def test_bundle_round_trip_with_long_names_and_old_times():
    changes = _changes()
    assert decode_bundle(encode_bundle("r", changes)) == ("r", changes)


def test_bundles_of_the_previous_format_still_decode():
    changes = _changes()
    assert decode_bundle(_v1("r", changes)) == ("r", changes)


def test_a_bundle_is_a_standard_tar_archive():
    changes = _changes()
    with tarfile.open(fileobj=io.BytesIO(encode_bundle("r", changes))) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [".sidecar-bundle.json", "r/a", "r/empty", LONG]
        assert json.loads(tar.extractfile(members[0]).read())["version"] == 2
        assert tar.extractfile(members[3]).read() == changes[3].data
        assert members[1].mode == 0o640 and members[1].mtime == 5


async def _read_in_pieces(blob: bytes, piece: int):
    async def chunks():
        for i in range(0, len(blob), piece):
            yield blob[i : i + piece]

    reader = BundleReader(chunks())
    root, header = await reader.header()
    got = {}
    async for c, body in reader.files():
        got[c.key] = b"".join([chunk async for chunk in body])
    return root, header, got


@pytest.mark.parametrize("fmt", ["v2", "v1"])
@pytest.mark.parametrize("piece", [1, 511, 4096, 10**9])
def test_a_bundle_is_read_as_its_chunks_arrive(fmt, piece):
    changes = _changes()
    if piece == 1:
        changes = changes[:3]  # byte by byte: the small ones only
    blob = encode_bundle("r", changes) if fmt == "v2" else _v1("r", changes)
    root, header, got = anyio.run(_read_in_pieces, blob, piece)
    assert root == "r" and [c.key for c in header] == [c.key for c in changes]
    assert all(c.data is None for c in header)  # the header names them; the bytes follow
    assert got == {c.key: c.data for c in changes if c.data is not None}


def _tampered(blob: bytes, find: bytes, replace: bytes) -> bytes:
    assert find in blob
    return blob.replace(find, replace, 1)


@pytest.mark.parametrize("mutate", [
    lambda b: b[:-1100],  # cut short in the last entry
    lambda b: b[:-1024],  # no end-of-archive blocks
    lambda b: b + b"trailing",
    lambda b: _tampered(b, b"\x00binary\n\x00binary", b"\x00BINARY\n\x00binary"),  # bytes not matching their sha256
    lambda b: _tampered(b, b"r/empty\x00", b"r/emptz\x00"),  # a member not where the header says (bad checksum)
    lambda b: b[:512] + b"[" + b[513:],  # a header that is not JSON
    lambda b: b"",
])
def test_damaged_bundles_are_refused_as_unreadable(mutate):
    blob = mutate(encode_bundle("r", _changes()))
    with pytest.raises(BundleError):
        decode_bundle(blob)
    with pytest.raises(BundleError):
        anyio.run(_read_in_pieces, blob, 4096)


def test_a_member_renamed_consistently_is_still_refused():
    """A member whose name differs from its header entry is refused, even with a valid checksum."""
    a = b"abc"
    changes = [Change("r/a", a, ObjectMeta.of(a, 1, 0o600)), Change("r/b", a, ObjectMeta.of(a, 1, 0o600))]
    tar = io.BytesIO()
    good = encode_bundle("r", changes)
    with tarfile.open(fileobj=tar, mode="w", format=tarfile.PAX_FORMAT) as t, tarfile.open(fileobj=io.BytesIO(good)) as src:
        for m in src.getmembers():
            data = src.extractfile(m).read()
            if m.name == "r/b":
                m.name = "r/c"
            t.addfile(m, io.BytesIO(data))
    with pytest.raises(BundleError, match="not where its header says"):
        decode_bundle(tar.getvalue())


def test_a_streamed_bundle_reads_files_from_the_disk_and_refuses_a_changed_one(tmp_path):
    from sidecar.localfs import Unstable, hash_stable
    from sidecar.paths import Root

    root = Root("r", str(tmp_path))
    (tmp_path / "big").write_bytes(b"1" * 3_000_000)
    held = b"held"
    source, meta = hash_stable(root, ["big"], 2**40)
    changes = [Change("r/big", source, meta), Change("r/held", held, ObjectMeta.of(held, 1, 0o600))]
    bundle = BundleSource.measure("r", changes)
    blob = b"".join(bundle.iter_sync())
    assert len(blob) == bundle.size and hashlib.md5(blob).digest() == bundle.md5
    assert hashlib.sha256(blob).hexdigest() == bundle.sha256
    _, back = decode_bundle(blob)
    assert back[0].data == b"1" * 3_000_000 and back[1].data == held

    async def via_chunks():
        return b"".join([c async for c in bundle.chunks()])

    assert anyio.run(via_chunks) == blob
    (tmp_path / "big").write_bytes(b"2" * 3_000_000)  # the host wrote again: the bundle must not be stored
    with pytest.raises(Unstable):
        b"".join(bundle_chunks("r", changes))


# -- the byte budget --------------------------------------------------------------------------

def test_the_byte_budget_never_exceeds_its_total_and_serves_in_order():
    from sidecar.localfs import ByteBudget

    budget = ByteBudget(10)
    order: list[int] = []
    peak = 0

    async def take(n, i, hold):
        nonlocal peak
        async with budget.hold(n):
            order.append(i)
            peak = max(peak, budget.used)
            await hold.wait()

    async def go():
        holds = [anyio.Event() for _ in range(4)]
        async with anyio.create_task_group() as tg:
            for i, n in enumerate([6, 6, 3, 100]):
                tg.start_soon(take, n, i, holds[i])
                await anyio.sleep(0.01)
            assert order == [0]  # 1 waits for 0; 2 would fit but waits its turn
            holds[0].set()
            await anyio.sleep(0.01)
            assert order == [0, 1, 2]
            holds[1].set()
            holds[2].set()
            await anyio.sleep(0.01)
            assert order == [0, 1, 2, 3]  # more than the total takes all of it, alone
            holds[3].set()
        assert budget.used == 0

    anyio.run(go)
    assert peak <= 10


def test_a_cancelled_wait_gives_its_turn_away():
    from sidecar.localfs import ByteBudget

    budget = ByteBudget(10)

    async def go():
        release = anyio.Event()
        got_small = anyio.Event()

        async def holder():
            async with budget.hold(8):
                await release.wait()

        async def small():
            async with budget.hold(2):
                got_small.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await anyio.sleep(0.01)
            with anyio.move_on_after(0.05):
                async with budget.hold(5):  # waits behind the holder, then gives up
                    raise AssertionError("not granted")
            tg.start_soon(small)
            with anyio.fail_after(5):
                await got_small.wait()  # not held back by the cancelled request
            release.set()
        assert budget.used == 0 and not budget._waiting

    anyio.run(go)


def test_small_bodies_never_wait_for_the_budget():
    from sidecar.localfs import SMALL_BODY, STREAM_CHUNK, STREAM_MIN, body_bytes

    assert body_bytes(100 * 1024) == 0 and body_bytes(SMALL_BODY) == 0
    assert body_bytes(SMALL_BODY + 1) == SMALL_BODY + 1 and body_bytes(STREAM_MIN) == STREAM_MIN
    assert body_bytes(STREAM_MIN + 1) == STREAM_CHUNK


# -- a commit whose streamed file changes after its bundle was stored ---------------------------

def test_a_streamed_file_changed_after_the_bundle_leaves_a_restorable_state(tmp_path, monkeypatch):
    """The bundle is stored; then the host rewrites a streamed file before its own object is: that
    put stores nothing, the commit reports the disk moved and the bundle stays, so a restore gives
    the snapshot's state (the bundle over the objects). The next commit stores the new state."""
    from sidecar import snapshot
    from sidecar.known import StoreState
    from sidecar.metrics import Totals
    from sidecar.paths import IgnoreRules, Root
    from sidecar.restore.latest import restore
    from sidecar.store.directory import DirectoryStore
    from sidecar.writer import Writer

    monkeypatch.setattr(snapshot, "HELD_MAX", 1024)  # the large file is streamed, the small one held
    work = tmp_path / "work"
    work.mkdir()
    root = Root("state", str(work))
    (work / "big.bin").write_bytes(b"1" * 100_000)
    (work / "bindings.json").write_bytes(b'{"checkpoint": 1}')

    class RewriteAfterBundle(DirectoryStore):
        rewrite = True

        async def put(self, key, data, meta, **conditions):
            info = await super().put(key, data, meta, **conditions)
            if key == snapshot.bundle_key("state") and self.rewrite:
                self.rewrite = False
                (work / "big.bin").write_bytes(b"2" * 100_000)  # the host's next superstep, half written
            return info

    async def go():
        store = RewriteAfterBundle(str(tmp_path / "store"))
        await store.open()
        known = StoreState()

        committer = snapshot.Committer(Writer(store), [root], IgnoreRules(), known, max_file_size=2**30,
                                       totals=Totals())
        keys = ["state/big.bin", "state/bindings.json"]
        assert await committer.commit(root, keys) is False
        assert known.has_bundle("state")
        first = tmp_path / "first"
        await restore(store, [Root("state", str(first))])
        assert (first / "big.bin").read_bytes() == b"1" * 100_000  # the snapshot, from the bundle
        assert (first / "bindings.json").read_bytes() == b'{"checkpoint": 1}'

        assert await committer.commit(root, keys) is True
        assert not known.has_bundle("state")
        second = tmp_path / "second"
        await restore(store, [Root("state", str(second))])
        assert (second / "big.bin").read_bytes() == b"2" * 100_000
        assert not (tmp_path / "store" / ".sidecar" / "bundles" / "state").exists()

    anyio.run(go)
