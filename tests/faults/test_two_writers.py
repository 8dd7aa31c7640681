"""Two writers: an old compute still draining while the new one starts. The newer sidecar fences the
older one, whose uploads and deletes are then refused, so it can never overwrite or delete the new
one's files."""

from __future__ import annotations

import contextlib

import pytest

from support import Sidecar, disk_tree, store_tree, wait_for, write_atomic

pytestmark = pytest.mark.faults


@pytest.mark.parametrize("backend", ["directory", "azure"])
def test_newer_sidecar_fences_the_older(tmp_path, backend, request):
    env_extra = {}
    if backend == "azure":
        endpoint = request.getfixturevalue("azurite")
        from tests.azurite import unique_container

        store = endpoint.container_url(unique_container("fence"))
        env_extra = endpoint.env()
        listing = lambda: _azure_tree(endpoint, store)  # noqa: E731
    else:
        store = str(tmp_path / "store")
        listing = lambda: store_tree(tmp_path / "store")  # noqa: E731
    from support import sidecar_env

    env = sidecar_env(SIDECAR_FENCE_WINDOW="0.5", **env_extra)
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    a = Sidecar(old, "sync", "--store", store, env=env)
    a.wait_event("ready")
    write_atomic(old / ".checkpoints" / "c" / "shared.json", b"from the old compute")
    write_atomic(old / ".checkpoints" / "c" / "keep.json", b"keep me")
    wait_for(lambda: listing() == disk_tree(old / ".checkpoints"), 20, "old writer mirrored")

    b = Sidecar(new, "sync", "--store", store, env=env)  # restores what the old one stored
    b.wait_event("ready")
    assert disk_tree(new / ".checkpoints") == disk_tree(old / ".checkpoints")
    write_atomic(new / ".checkpoints" / "c" / "shared.json", b"from the new compute")
    wait_for(lambda: listing().get("c/shared.json") == b"from the new compute", 20, "new writer's upload")

    # the old compute keeps going: a stale rewrite, a new file and a delete
    write_atomic(old / ".checkpoints" / "c" / "shared.json", b"STALE")
    write_atomic(old / ".checkpoints" / "c" / "late.json", b"late")
    (old / ".checkpoints" / "c" / "keep.json").unlink()
    a.wait_event("fenced")
    assert a.stop() == 75  # its changes were left pending, and it says so
    assert a.has_event("shutdown_pending")

    assert listing() == disk_tree(new / ".checkpoints") == {
        "c/shared.json": b"from the new compute", "c/keep.json": b"keep me"}
    assert b.stop() == 0


def _azure_tree(endpoint, container_url: str) -> dict[str, bytes]:
    import asyncio

    from azure.storage.blob.aio import ContainerClient

    async def go():
        name = container_url.rstrip("/").rsplit("/", 1)[1]
        async with ContainerClient.from_connection_string(endpoint.connection_string, name) as cc:
            out = {}
            async for blob in cc.list_blobs(name_starts_with=".checkpoints/"):
                out[blob.name.split("/", 1)[1]] = await (await cc.download_blob(blob.name)).readall()
            return out

    return asyncio.run(go())


def test_losing_a_simultaneous_claim_fences_us_before_any_write(tmp_path):
    """Two sidecars claiming at the same moment: the one whose generation is not the highest
    writes nothing and says so (health ``fenced``); a ``run`` then stops its host
    (tests/integration/test_fence_run.py)."""
    import anyio

    from sidecar.config import load
    from sidecar.daemon import Daemon
    from sidecar.marker import OWNER_KEY
    from sidecar.store import make_store
    from sidecar.store.base import ObjectMeta

    work = tmp_path / "work"
    write_atomic(work / ".checkpoints" / "c" / "mine.json", b"mine")
    settings, roots = load({"store": str(tmp_path / "store"), "roots": str(work / ".checkpoints"),
                            "reconcile_interval": 0}, cwd=str(work))
    store = make_store(settings.store)

    class RacedStore(type(store)):
        """Shows our claim the marker as it was just before another sidecar claimed the same generation."""

        async def get_stream(self, key):  # the marker is read as a stream
            if key == OWNER_KEY:
                from sidecar.store.base import NotFound
                raise NotFound(key)
            return await super().get_stream(key)

    store.__class__ = RacedStore

    async def main():
        await store.open()
        # the other's stamp: generation 1 with low bits no claim of ours can draw (all ones)
        stamp = (1 << 32) | (2**32 - 1)
        marker = b'{"generation": %d, "owner": "other", "heartbeat": 0}' % stamp
        await store.put(OWNER_KEY, marker, ObjectMeta.of(marker, stamp, 0o600, version=stamp))
        daemon = Daemon(settings, roots, store)
        await daemon.prepare()
        async with anyio.create_task_group() as tg:
            await tg.start(daemon.serve)
            with anyio.fail_after(10):
                await daemon.uploader.fenced.wait()
                while daemon.health.phase != "fenced":
                    await anyio.sleep(0.01)
            assert daemon.uploader.pending_keys() == {".checkpoints/c/mine.json"}  # kept, not written
            tg.cancel_scope.cancel()
        assert [i.key async for i in store.list()] == [OWNER_KEY]
        assert "same moment" in daemon.health.reason
        await store.aclose()

    anyio.run(main)


def _recording_store(path, slow_owner_read: float = 0.0, refuse_owner_write: bool = False):
    """A directory store that records its writes (and can be slow to read, or refuse to write,
    the owner marker), to see what reaches the store before the claim."""
    import anyio

    from sidecar.marker import OWNER_KEY
    from sidecar.store.base import StoreError
    from sidecar.store.directory import DirectoryStore

    class Recording(DirectoryStore):
        recorded: list[str] = []

        async def get_stream(self, key):  # the marker is read as a stream
            if key == OWNER_KEY and slow_owner_read:
                await anyio.sleep(slow_owner_read)
            return await super().get_stream(key)

        async def put(self, key, data, meta, **conditions):
            if key == OWNER_KEY and refuse_owner_write:
                raise StoreError("403 AuthorizationPermissionMismatch (a read-only credential)")
            self.recorded.append(f"put {key}")
            return await super().put(key, data, meta, **conditions)

        async def delete(self, key):
            self.recorded.append(f"delete {key}")
            return await super().delete(key)

    return Recording(str(path))


def test_no_write_or_delete_reaches_the_store_before_the_claim(tmp_path):
    """Found by review: the cleanup of a stale snapshot bundle deleted it before the claim."""
    import time

    import anyio

    from sidecar.config import load
    from sidecar.daemon import Daemon
    from sidecar.marker import OWNER_KEY
    from sidecar.snapshot import bundle_key, encode_bundle
    from sidecar.store.base import ObjectMeta

    work = tmp_path / "work"
    write_atomic(work / "state" / "a.json", b"a")  # the stored bytes already: merged, nothing to download
    settings, roots = load({"store": str(tmp_path / "store"), "roots": "state", "commit": "snapshot",
                            "reconcile_interval": 0}, cwd=str(work))
    store = _recording_store(tmp_path / "store", slow_owner_read=0.3)

    async def main():
        await store.open()
        blob = encode_bundle("state", [])  # an older sidecar's cut-short commit, nothing left to do
        await store.put(bundle_key("state"), blob, ObjectMeta.of(blob, time.time_ns(), 0o600))
        st = (work / "state" / "a.json").stat()  # and the file already stored: nothing pending
        await store.put("state/a.json", b"a", ObjectMeta.of(b"a", st.st_mtime_ns, st.st_mode & 0o7777))
        store.recorded.clear()
        daemon = Daemon(settings, roots, store)
        await daemon.prepare()
        async with anyio.create_task_group() as tg:
            await tg.start(daemon.serve)
            with anyio.fail_after(10):
                while f"delete {bundle_key('state')}" not in store.recorded:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        await store.aclose()

    anyio.run(main)
    assert store.recorded[0] == f"put {OWNER_KEY}", store.recorded


def test_a_claim_the_store_refuses_is_retried_and_reported_and_nothing_is_written(tmp_path):
    import anyio

    from sidecar.config import load
    from sidecar.daemon import Daemon

    work = tmp_path / "work"
    write_atomic(work / ".checkpoints" / "c" / "a.json", b"a")
    settings, roots = load({"store": str(tmp_path / "store"), "roots": str(work / ".checkpoints"),
                            "reconcile_interval": 0}, cwd=str(work))
    store = _recording_store(tmp_path / "store", refuse_owner_write=True)

    async def main():
        await store.open()
        daemon = Daemon(settings, roots, store)
        await daemon.prepare()
        async with anyio.create_task_group() as tg:
            await tg.start(daemon.serve)
            with anyio.fail_after(10):
                while daemon.uploader.store_health.failing_since is None:  # degraded: /readyz and metrics say so
                    await anyio.sleep(0.01)
            assert daemon.uploader.pending_keys() == {".checkpoints/c/a.json"}
            with anyio.move_on_after(0.5, shield=True):
                assert await daemon.drain(0.3) == 1  # left pending, and release() wrote nothing
            tg.cancel_scope.cancel()
        await store.aclose()

    anyio.run(main)
    assert store.recorded == []


def test_two_claims_of_the_same_generation_leave_exactly_one_owner(tmp_path):
    """Both sidecars read the marker before either writes, so both claim the same generation, and
    their writes race. The store must end up with one owner: the other's claim is refused, or it
    is fenced at its next proof of ownership. (Before stamps had random low bits, both wrote the
    same stamp, the store took both, and neither was ever fenced; before the directory store
    locked its own objects' check-then-replace, the lower stamp could land last and both stayed
    owners.) Repeated, so that both orders of the two writes come up."""
    import anyio

    from sidecar.fence import Fence, Fenced
    from sidecar.marker import OWNER_KEY
    from sidecar.store.base import NotFound, Stream
    from sidecar.store.directory import DirectoryStore

    class BothReadFirst(DirectoryStore):
        """Answers the owner marker's reads only once both claimants have read it whole: the gate
        stands after the read, so neither claimant can write before the other has read."""

        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.readers = 0
            self.both = anyio.Event()

        async def get_stream(self, key, read_ahead=0):  # the marker is read as a stream
            if key != OWNER_KEY:
                return await super().get_stream(key, read_ahead)
            try:
                info, stream = await super().get_stream(key)
                body = b"".join([chunk async for chunk in stream])
            except NotFound:
                info = None
            self.readers += 1
            if self.readers == 2:
                self.both.set()
            await self.both.wait()
            if info is None:
                raise NotFound(key)

            async def replay():
                yield body

            return Stream(info, replay())

    async def one_round(n: int) -> list[str]:
        store = BothReadFirst(str(tmp_path / f"store{n}"))
        await store.open()
        fences = [Fence(store, window=0.05, margin=0.0) for _ in range(2)]

        async def claim(f: Fence) -> None:
            with contextlib.suppress(Fenced):  # its claim was the one refused: fenced before any write
                await f.claim()

        async with anyio.create_task_group() as tg:
            for f in fences:
                tg.start_soon(claim, f)
        assert all(f.generation == 1 or f.fenced for f in fences)
        t = anyio.current_time() + 0.06
        while anyio.current_time() < t:  # past the window: the next write needs a fresh proof
            await anyio.sleep(0.01)
        outcomes = []
        for f in fences:
            try:
                await f.before_write()
                outcomes.append("owner")
            except Fenced as e:
                outcomes.append("fenced")
                assert "at the same moment" in str(e)
        await store.aclose()
        return sorted(outcomes)

    async def main():
        for n in range(20):
            assert await one_round(n) == ["fenced", "owner"]

    anyio.run(main)


def test_a_snapshot_commit_stops_at_the_first_write_after_it_is_fenced(tmp_path):
    """A commit is many writes; ownership is proven before each of them, not once for the whole
    commit: once a newer sidecar owns the prefix, not one more of our writes reaches it."""
    import anyio

    from sidecar.fence import Fence, Fenced
    from sidecar.marker import OWNER_KEY
    from sidecar.paths import IgnoreRules, make_roots
    from sidecar.store.base import ObjectMeta
    from sidecar.store.directory import DirectoryStore
    from sidecar.uploader import Uploader
    from sidecar.writer import Writer

    state = tmp_path / "state"
    roots = make_roots([str(state)], str(tmp_path))
    name = roots[0].name
    keys = [f"{name}/{i}.json" for i in range(3)]
    for i in range(3):
        write_atomic(state / f"{i}.json", b"%d" % i)

    now = [0.0]  # the fence's clock: each stored file takes longer than a window

    class TakenOverAfterOneFile(DirectoryStore):
        written: list[str] = []

        async def put(self, key, data, meta, **conditions):
            info = await super().put(key, data, meta, **conditions)
            if key != OWNER_KEY:
                now[0] += 2.0
            if key in keys:
                type(self).written.append(key)
                if len(type(self).written) == 1:  # a newer sidecar claims the prefix now
                    newer = b'{"generation": %d, "owner": "newer", "heartbeat": 0}' % (9 << 32)
                    await super().put(OWNER_KEY, newer, ObjectMeta.of(newer, 9 << 32, 0o600, version=9 << 32))
            return info

    async def main():
        store = TakenOverAfterOneFile(str(tmp_path / "store"))
        await store.open()
        fence = Fence(store, window=1.0, margin=0.0, clock=lambda: now[0])  # every write needs a fresh proof
        await fence.claim()
        uploader = Uploader(Writer(store, fence), roots, IgnoreRules(), snapshot_roots={name})
        with anyio.fail_after(10), pytest.raises(Fenced):
            await uploader.committer.commit(roots[0], keys)
        assert uploader.fenced.is_set()
        assert len(TakenOverAfterOneFile.written) == 1
        await store.aclose()

    anyio.run(main)


@pytest.mark.parametrize("garbage", [b"garbage{", b"[1, 2]", b""])
def test_a_garbled_owner_marker_is_refused_until_released_never_fenced_for_ever(tmp_path, garbage):
    """The marker's bytes replaced by something that is no JSON object: whose namespace it is
    cannot be told, so the next sidecar refuses it (one line, exit 2); once ``release`` rewrites
    it, a sidecar claims above the version the store holds it at and mirrors."""
    from support import Sidecar, run_cli, sidecar_env

    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"))
    work = tmp_path / "w"
    for n in range(3):
        write_atomic(work / ".checkpoints" / f"c{n}.json", b"x")
        assert run_cli("run", "--", "true", cwd=work, env=env).returncode == 0
    (tmp_path / "store" / ".sidecar" / "owner").write_bytes(garbage)
    r = run_cli("sync", cwd=work, env=env)
    assert r.returncode == 2 and "'.sidecar/owner'" in r.stderr and "cannot be read" in r.stderr, r.stderr
    # written moments ago: it may be a live sidecar's, so release asks for --force first
    assert run_cli("release", cwd=work, env=env).returncode == 2
    assert run_cli("release", "--force", cwd=work, env=env).returncode == 0
    sc = Sidecar(work, "sync", env=env)
    sc.wait_event("ready")
    write_atomic(work / ".checkpoints" / "after.json", b"mirrored")
    wait_for(lambda: store_tree(tmp_path / "store").get("after.json") == b"mirrored", 30, "the write mirrored")
    assert not sc.has_event("fenced")
    assert sc.stop() == 0
