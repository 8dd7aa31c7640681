"""The write gate, on a fake store and a fake clock: every put and delete that reaches the store
follows a proof of ownership younger than the fence's window, none comes before the claim or after
being fenced, a proof is a read of the marker (not a write), and the heartbeat never brings a
fenced claim back. Time is the fake clock's alone: requests and the work between them (reading,
hashing, listing) advance it, so no assertion depends on the machine's speed."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import anyio
import pytest

from sidecar.fence import Fence, Fenced
from sidecar.marker import OWNER_KEY, STORED_VERSION, read_marker
from sidecar.store.base import NotFound, ObjectInfo, ObjectMeta, Stream
from tests.memstore import FakeClock

WINDOW, MARGIN = 2.0, 8.0


@dataclass
class Request:
    op: str  # get, put, delete, list
    key: str
    sent: float
    served: float
    landed: bool = False  # a put or delete that changed the store
    version: int = 0  # a get's or put's resulting stored version


@dataclass
class FakeStore:
    """An in-memory store with the interface's rules (supersede on version, ``if_version`` a
    compare-and-swap); each request takes ``latency`` fake seconds and is served halfway."""

    clock: FakeClock
    latency: float = 0.05
    list_latency: float = 0.05
    description: str = "fake"
    objects: dict[str, tuple[bytes, ObjectInfo]] = field(default_factory=dict)
    log: list[Request] = field(default_factory=list)

    async def _request(self, op: str, key: str, latency: float) -> Request:
        r = Request(op, key, self.clock.now, self.clock.now + latency / 2)
        self.clock.advance(latency / 2)
        self.log.append(r)
        await anyio.sleep(0)
        return r

    async def _done(self) -> None:
        self.clock.advance(self.latency / 2)
        await anyio.sleep(0)

    async def open(self) -> None:
        pass

    async def put(self, key, data, meta: ObjectMeta, if_version=None, expected=None) -> ObjectInfo:
        r = await self._request("put", key, self.latency)
        stored = self.objects.get(key)
        held = stored[1].version if stored else 0
        if (if_version is not None and held != if_version) or held > meta.version:
            assert stored is not None or if_version is not None
            info = stored[1] if stored else ObjectInfo(key, 0, None, 0, 0)
        else:
            info = ObjectInfo(key, meta.size, meta.sha256, meta.mtime_ns, meta.mode, version=meta.version)
            self.objects[key] = (bytes(data), info)
            r.landed = True
        r.version = info.version
        await self._done()
        return info

    async def get(self, key):
        r = await self._request("get", key, self.latency)
        got = self.objects.get(key)
        r.version = got[1].version if got else 0
        await self._done()
        if got is None:
            raise NotFound(key)
        return got

    async def get_stream(self, key):
        data, info = await self.get(key)  # one request, as get (the fence reads its marker streamed)

        async def chunks():
            yield data

        return Stream(info, chunks())

    async def list(self, prefix=""):
        await self._request("list", prefix, self.list_latency)
        for key in sorted(self.objects):
            if key.startswith(prefix):
                yield self.objects[key][1]

    async def delete(self, key):
        r = await self._request("delete", key, self.latency)
        self.objects.pop(key, None)
        r.landed = True
        await self._done()

    async def aclose(self) -> None:
        pass

    def successor_claims(self) -> int:
        """A newer sidecar's claim, served now: its stamp above ours."""
        current = json.loads(self.objects[OWNER_KEY][0])
        stamp = ((current["generation"] >> 32) + 1) << 32
        body = json.dumps({"generation": stamp, "owner": "successor", "heartbeat": 1.0}).encode()
        info = ObjectInfo(OWNER_KEY, len(body), None, stamp, 0o600, version=stamp)
        self.objects[OWNER_KEY] = (body, info)
        self.log.append(Request("put", OWNER_KEY, self.clock.now, self.clock.now, landed=True, version=stamp))
        return stamp


def data_writes(store: FakeStore) -> list[Request]:
    return [r for r in store.log if r.op in ("put", "delete") and r.key != OWNER_KEY]


def assert_gated(store: FakeStore, fence: Fence, successor_at: float | None = None) -> None:
    """Every data write follows (in the log) a proof sent less than a window before it: a marker
    read that showed our stamp, or our own marker write that landed. None before the claim
    landed; with a successor, none sent a window or more after its claim."""
    claim = next(r for r in store.log if r.key == OWNER_KEY and r.op == "put" and r.landed)
    last_proof: float | None = None
    for r in store.log:
        if r.key == OWNER_KEY:
            if r.version == fence.stamp and (r.op == "get" or r.landed):
                last_proof = r.sent
            continue
        if r.op not in ("put", "delete"):
            continue
        assert r.sent >= claim.served, f"{r} before the claim"
        assert last_proof is not None and r.sent - last_proof < WINDOW, f"{r}: last proof at {last_proof}"
        if successor_at is not None:
            assert r.sent < successor_at + WINDOW, f"{r} after the successor's claim at {successor_at}"


def meta(data: bytes) -> ObjectMeta:
    return ObjectMeta.of(data, 1, 0o600)


def make(clock: FakeClock, store: FakeStore, **kw):
    from sidecar.writer import Writer

    fence = Fence(store, WINDOW, MARGIN, clock=clock, sleep=clock.sleep, floor=0, **kw)
    return fence, Writer(store, fence)


@pytest.mark.parametrize("seed", range(12))
def test_every_write_follows_a_fresh_proof_and_none_follows_the_fence(seed):
    """Workers that each wait for the claim, do some work (a read, a hash: 0 to 3 windows of fake
    time), then put or delete; heartbeats now and then; a successor claims partway through."""
    rng = random.Random(seed)
    clock = FakeClock()
    store = FakeStore(clock, latency=rng.choice([0.001, 0.05, 0.5]))
    fence, writer = make(clock, store)
    successor_at: list[float] = []
    refused_after_fenced = []

    async def worker(n: int) -> None:
        for i in range(40):
            try:
                await writer.ready()
                clock.advance(rng.uniform(0, 3 * WINDOW) if rng.random() < 0.3 else rng.uniform(0, 0.2))
                if rng.random() < 0.2:
                    await writer.delete(f"r/{n}-{i - 1}")
                else:
                    await writer.put(f"r/{n}-{i}", b"x", meta(b"x"))
            except Fenced:
                refused_after_fenced.append(n)
                assert writer.fenced.is_set()
                return
            await anyio.sleep(0)

    async def successor() -> None:
        for _ in range(rng.randint(20, 200)):
            await anyio.sleep(0)
        successor_at.append(clock.now)
        store.successor_claims()

    async def heartbeats() -> None:
        for _ in range(10):
            for _ in range(rng.randint(5, 30)):
                await anyio.sleep(0)
            try:
                await fence.heartbeat()
            except Fenced:
                return

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for n in range(3):
                tg.start_soon(worker, n)
            tg.start_soon(heartbeats)
            tg.start_soon(successor)
            await anyio.sleep(0)
            await writer.claim()

    anyio.run(main)
    assert data_writes(store), "the workload wrote something"
    assert_gated(store, fence, successor_at[0])
    if writer.fenced.is_set():
        fenced_at = max(r.served for r in store.log if r.key == OWNER_KEY and r.op == "get")
        assert not [r for r in data_writes(store) if r.sent > fenced_at]
    # the successor's marker is still there: no heartbeat or proof of ours replaced it
    marker = anyio.run(read_marker, store)
    assert marker["owner"] == "successor" and marker[STORED_VERSION] > fence.stamp


def test_a_proof_is_a_read_and_idle_costs_nothing():
    """Ten sparse writes, each more than a window after the last: one marker read before each,
    and no marker write but the claim's."""
    clock = FakeClock()
    store = FakeStore(clock)
    fence, writer = make(clock, store)

    async def main() -> None:
        await writer.claim()
        for i in range(10):
            clock.advance(3.0)
            await writer.ready()
            await writer.put(f"r/{i}", b"x", meta(b"x"))
        before = len(store.log)
        clock.advance(3600)  # an idle hour: no request at all without a heartbeat
        assert len(store.log) == before

    anyio.run(main)
    marker_puts = [r for r in store.log if r.key == OWNER_KEY and r.op == "put"]
    marker_gets = [r for r in store.log if r.key == OWNER_KEY and r.op == "get"]
    assert len(marker_puts) == 1  # the claim
    assert len(marker_gets) == 1 + 10  # the claim's read, then one proof per sparse write
    assert len(data_writes(store)) == 10
    assert_gated(store, fence)


def test_writes_within_a_window_share_one_proof():
    clock = FakeClock()
    store = FakeStore(clock, latency=0.01)
    fence, writer = make(clock, store)

    async def main() -> None:
        await writer.claim()
        clock.advance(WINDOW)
        for i in range(50):
            await writer.put(f"r/{i}", b"x", meta(b"x"))

    anyio.run(main)
    proofs = [r for r in store.log if r.key == OWNER_KEY and r.op == "get"][1:]
    assert 1 <= len(proofs) <= 1 + 50 * 0.01 / WINDOW + 1
    assert_gated(store, fence)


def test_no_write_before_a_predecessors_window_has_passed():
    """The predecessor did not release the namespace: our first write waits window + margin after
    the claim, counted on our clock; the wait proves nothing, the write's own proof follows it."""
    clock = FakeClock()
    store = FakeStore(clock)
    body = json.dumps({"generation": 1 << 32, "owner": "old", "heartbeat": 5.0}).encode()
    store.objects[OWNER_KEY] = (body, ObjectInfo(OWNER_KEY, len(body), None, 0, 0o600, version=1 << 32))
    fence, writer = make(clock, store)

    async def main() -> None:
        await writer.claim()
        claimed = clock.now
        await writer.put("r/a", b"x", meta(b"x"))
        (write,) = data_writes(store)
        assert write.sent >= claimed + WINDOW + MARGIN

    anyio.run(main)
    assert_gated(store, fence)


@pytest.mark.parametrize("heartbeat", [5.0, 0], ids=["held", "released"])
def test_a_take_over_is_told_once_the_predecessors_window_has_passed(heartbeat):
    """``took_over``: True, after the window and the margin on our clock, when the predecessor had
    not released the namespace; False at once when it had. Unchecked, a held take-over is not
    released at the end: the next claim waits too."""
    clock = FakeClock()
    store = FakeStore(clock)
    body = json.dumps({"generation": 1 << 32, "owner": "old", "heartbeat": heartbeat}).encode()
    store.objects[OWNER_KEY] = (body, ObjectInfo(OWNER_KEY, len(body), None, 0, 0o600, version=1 << 32))
    fence, writer = make(clock, store)

    async def main() -> None:
        await writer.claim()
        claimed = clock.now
        assert await writer.took_over() == bool(heartbeat)
        assert clock.now >= claimed + (WINDOW + MARGIN if heartbeat else 0)
        await writer.release(1.0, checked=anyio.Event())

    anyio.run(main)
    assert (json.loads(store.objects[OWNER_KEY][0])["heartbeat"] != 0) == bool(heartbeat)


def test_a_fenced_heartbeat_never_brings_the_claim_back():
    clock = FakeClock()
    store = FakeStore(clock)
    fence, writer = make(clock, store)

    async def main() -> None:
        await writer.claim()
        await fence.heartbeat()  # ours: a compare-and-swap on our stamp, it lands
        assert json.loads(store.objects[OWNER_KEY][0])["owner"] == fence.owner
        theirs = store.successor_claims()
        clock.advance(WINDOW)
        with pytest.raises(Fenced):
            await fence.heartbeat()
        assert store.objects[OWNER_KEY][1].version == theirs
        with pytest.raises(Fenced):
            await writer.put("r/a", b"x", meta(b"x"))
        assert writer.fenced.is_set()
        await fence.heartbeat()  # fenced: nothing more is even tried
        assert store.objects[OWNER_KEY][1].version == theirs

    anyio.run(main)
    assert not data_writes(store)
    marker_writes = [r for r in store.log if r.key == OWNER_KEY and r.op == "put" and r.landed]
    assert [r.version for r in marker_writes][-1] > fence.stamp


def test_a_lost_marker_is_written_again_by_the_next_proof():
    """No marker at the proof (deleted by hand): ours is written back (the store would refuse it
    over a higher one), and the write goes ahead."""
    clock = FakeClock()
    store = FakeStore(clock)
    fence, writer = make(clock, store)

    async def main() -> None:
        await writer.claim()
        del store.objects[OWNER_KEY]
        clock.advance(WINDOW)
        await writer.put("r/a", b"x", meta(b"x"))

    anyio.run(main)
    assert store.objects[OWNER_KEY][1].version == fence.stamp
    assert len(data_writes(store)) == 1
    assert_gated(store, fence)


def test_nothing_is_written_after_the_release():
    clock = FakeClock()
    store = FakeStore(clock)
    fence, writer = make(clock, store)

    async def main() -> None:
        await writer.claim()
        await writer.put("r/a", b"x", meta(b"x"))
        await writer.release(1.0)
        assert json.loads(store.objects[OWNER_KEY][0])["heartbeat"] == 0
        await fence.heartbeat()  # a heartbeat after the release keeps it released
        assert json.loads(store.objects[OWNER_KEY][0])["heartbeat"] == 0
        with pytest.raises(Fenced):
            await writer.delete("r/a")

    anyio.run(main)
    assert [r.key for r in data_writes(store)] == ["r/a"]


def test_the_marker_is_the_fences_alone():
    clock = FakeClock()
    store = FakeStore(clock)
    _, writer = make(clock, store)

    async def main() -> None:
        await writer.claim()
        with pytest.raises(ValueError):
            await writer.put(OWNER_KEY, b"{}", meta(b"{}"))
        with pytest.raises(ValueError):
            await writer.delete(OWNER_KEY)

    anyio.run(main)


def test_a_put_is_stamped_and_a_newer_owners_object_is_told_apart():
    clock = FakeClock()
    store = FakeStore(clock)
    fence, writer = make(clock, store)

    async def main() -> None:
        await writer.claim()
        first = await writer.put("r/a", b"x", meta(b"x"))
        second = await writer.put("r/b", b"x", meta(b"x"))
        assert first.version >> 40 == fence.generation and second.version > first.version
        assert not writer.newer(first)
        newer = ObjectInfo("r/c", 1, None, 1, 0o600, version=(fence.generation + 1) << 40 | 1)
        store.objects["r/c"] = (b"y", newer)
        got = await writer.put("r/c", b"x", meta(b"x"))
        assert got == newer and writer.newer(got)

    anyio.run(main)


# -- the writers of a running sidecar prove right before the request, after their slow work ------

def test_an_upload_proves_after_reading_the_file_not_before(tmp_path, monkeypatch):
    """Reading and hashing a large file on slow storage takes longer than the window: the put
    must still follow a fresh proof."""
    from sidecar import uploader as uploader_mod
    from sidecar.paths import IgnoreRules, make_roots
    from support import write_atomic

    roots = make_roots([str(tmp_path / "state")], str(tmp_path))
    name = roots[0].name
    for i in range(3):
        write_atomic(tmp_path / "state" / f"{i}.json", b"%d" % i)
    clock = FakeClock()
    store = FakeStore(clock)
    fence, writer = make(clock, store)
    real = uploader_mod.read_for_upload

    def slow_read(*args, **kwargs):
        clock.advance(3 * WINDOW)  # a slow disk: the read outlasts any proof taken before it
        return real(*args, **kwargs)

    monkeypatch.setattr(uploader_mod, "read_for_upload", slow_read)

    async def main() -> None:
        up = uploader_mod.Uploader(writer, roots, IgnoreRules(), concurrency=2)
        async with anyio.create_task_group() as tg:
            await tg.start(up.run)
            up.mark_keys([f"{name}/{i}.json" for i in range(3)])
            with anyio.fail_after(10):
                await up.wait_idle()
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert len(data_writes(store)) == 3
    assert_gated(store, fence)


def test_the_stale_bundle_cleanup_proves_after_listing(tmp_path):
    """The cleanup lists the bundles (slowly) before it deletes: its delete needs a proof taken
    after the listing, not the one taken before it."""
    from sidecar.paths import IgnoreRules, make_roots
    from sidecar.snapshot import bundle_key
    from sidecar.uploader import Uploader

    roots = make_roots([str(tmp_path / "state")], str(tmp_path))
    name = roots[0].name
    clock = FakeClock()
    store = FakeStore(clock, list_latency=3 * WINDOW)
    store.objects[bundle_key(name)] = (b"left", ObjectInfo(bundle_key(name), 4, None, 1, 0o600, version=1))
    fence, writer = make(clock, store)

    async def main() -> None:
        up = Uploader(writer, roots, IgnoreRules(), snapshot_roots={name})
        await writer.claim()
        clock.advance(WINDOW)  # the claim's own proof is spent
        await up.drop_stale_bundles(set())

    anyio.run(main)
    assert [r.key for r in data_writes(store)] == [bundle_key(name)]
    assert_gated(store, fence)


def test_the_writers_put_is_the_stores_put_plus_a_reserved_version():
    """The writer stands in for the store (the uploader and the committer hold it instead): its
    ``put`` takes the store's arguments the same way, and adds only ``version`` (keyword only)."""
    import inspect

    from sidecar.store.base import Store
    from sidecar.writer import Writer

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    store, writer = shape(Store.put), shape(Writer.put)
    assert writer[:-1] == store
    assert writer[-1] == ("version", inspect.Parameter.KEYWORD_ONLY, None)
