"""The contract every store backend passes: the directory store and Azure Blob (on Azurite)."""

from __future__ import annotations

import hashlib
import os

import pytest

from sidecar.store.base import CHUNK_BYTES, NotFound, ObjectInfo, ObjectMeta, Store, StoreError

pytestmark = pytest.mark.anyio


def meta(data: bytes, mtime_ns: int = 1_700_000_000_123_456_789, mode: int = 0o640, version: int = 0) -> ObjectMeta:
    return ObjectMeta.of(data, mtime_ns, mode, version)


async def listed(store: Store, prefix: str = "") -> dict[str, ObjectInfo]:
    return {info.key: info async for info in store.list(prefix)}


async def test_is_a_store(make_store):
    store = await make_store()
    assert isinstance(store, Store)
    assert store.description


async def test_put_get_round_trip_with_metadata(make_store):
    store = await make_store()
    data = b'{"checkpoint": 1}'
    m = meta(data, mtime_ns=1_700_000_000_987_654_321, mode=0o640)
    info = await store.put("root/a/ckpt.json", data, m)
    assert (info.key, info.size, info.sha256, info.mtime_ns, info.mode) == (
        "root/a/ckpt.json", len(data), m.sha256, m.mtime_ns, 0o640)
    assert info.same_as(m) and info.etag
    got, ginfo = await store.get("root/a/ckpt.json")
    assert got == data
    assert ginfo.same_as(m) and ginfo.key == "root/a/ckpt.json" and ginfo.etag


async def test_overwrite_with_newer(make_store):
    store = await make_store()
    await store.put("r/f", b"one", meta(b"one", mtime_ns=1000))
    info = await store.put("r/f", b"two two", meta(b"two two", mtime_ns=2000, mode=0o600))
    assert info.mtime_ns == 2000 and info.size == 7
    data, ginfo = await store.get("r/f")
    assert data == b"two two" and ginfo.same_as(meta(b"two two", 2000, 0o600))
    assert list(await listed(store)) == ["r/f"]


async def test_list_by_prefix_and_nested_keys(make_store):
    store = await make_store()
    keys = ["r/a.json", "r/sub/b.json", "r/sub/deeper/c", "rx/y", "other/x"]
    metas = {}
    for i, k in enumerate(keys):
        data = k.encode() * (i + 1)
        metas[k] = meta(data, mtime_ns=1000 + i, mode=0o600 + i)
        await store.put(k, data, metas[k])
    everything = await listed(store)
    assert sorted(everything) == sorted(keys)
    for k, info in everything.items():
        assert info.same_as(metas[k]), k
        assert info.etag
    assert sorted(await listed(store, "r/")) == ["r/a.json", "r/sub/b.json", "r/sub/deeper/c"]
    assert sorted(await listed(store, "r/sub/")) == ["r/sub/b.json", "r/sub/deeper/c"]
    assert sorted(await listed(store, "r")) == ["r/a.json", "r/sub/b.json", "r/sub/deeper/c", "rx/y"]
    assert sorted(await listed(store, "r/sub/deeper/c")) == ["r/sub/deeper/c"]
    assert await listed(store, "nothing/") == {}


async def test_list_of_empty_store(make_store):
    store = await make_store("fresh")
    assert await listed(store) == {}


async def test_delete_is_idempotent(make_store):
    store = await make_store()
    await store.put("r/d/x", b"x", meta(b"x"))
    await store.put("r/d/keep", b"k", meta(b"k"))
    await store.delete("r/d/x")
    with pytest.raises(NotFound):
        await store.get("r/d/x")
    assert list(await listed(store)) == ["r/d/keep"]
    await store.delete("r/d/x")
    await store.delete("never/was/here")
    assert list(await listed(store)) == ["r/d/keep"]


async def test_get_missing_is_not_found(make_store):
    store = await make_store()
    for key in ("missing", "r/missing/deeper.json"):
        with pytest.raises(NotFound):
            await store.get(key)


async def test_binary_and_empty_files(make_store):
    store = await make_store()
    binary = bytes(range(256)) * 17 + b"\x00\xff\r\n"
    for key, data in (("r/bin", binary), ("r/empty", b"")):
        m = meta(data)
        assert (await store.put(key, data, m)).same_as(m)
        got, info = await store.get(key)
        assert got == data and info.same_as(m)
    assert (await listed(store))["r/empty"].sha256 == hashlib.sha256(b"").hexdigest()
    assert (await listed(store))["r/empty"].size == 0


async def test_five_mib_object(make_store):
    store = await make_store()
    data = os.urandom(5 * 1024 * 1024)
    m = meta(data)
    await store.put("r/big.bin", data, m)
    got, info = await store.get("r/big.bin")
    assert got == data and info.same_as(m)
    assert (await listed(store, "r/big"))["r/big.bin"].same_as(m)


@pytest.mark.parametrize("read_ahead", [0, 1, 3])
async def test_a_streamed_read_gives_the_bytes_in_order_whatever_the_read_ahead(make_store, read_ahead):
    store = await make_store()
    data = os.urandom(CHUNK_BYTES * 3 + 12345)  # three whole chunks and a part
    await store.put("r/big.bin", data, meta(data))
    async with await store.get_stream("r/big.bin", read_ahead) as (info, chunks):
        got = [c async for c in chunks]
    assert info.size == len(data)
    assert b"".join(got) == data and all(len(c) <= CHUNK_BYTES for c in got)


async def test_a_streamed_read_closed_early_leaves_nothing_running(make_store):
    store = await make_store()
    data = os.urandom(CHUNK_BYTES * 4)
    await store.put("r/big.bin", data, meta(data))
    async with await store.get_stream("r/big.bin", 3) as (_, chunks):
        assert await chunks.__anext__() == data[:CHUNK_BYTES]
    # leaving the block closed the chunks: those fetched ahead are dropped, none is read again
    with pytest.raises(StopAsyncIteration):
        await chunks.__anext__()
    got, _ = await store.get("r/big.bin")  # and the store is still usable
    assert got == data
    stream = await store.get_stream("r/big.bin", 3)  # unpacked, the caller closes it
    assert await stream.chunks.__anext__() == data[:CHUNK_BYTES]
    await stream.aclose()
    with pytest.raises(StopAsyncIteration):
        await stream.chunks.__anext__()


async def test_a_stream_left_by_an_error_is_closed(make_store):
    store = await make_store()
    data = os.urandom(CHUNK_BYTES * 2)
    await store.put("r/big.bin", data, meta(data))
    with pytest.raises(KeyError):
        async with await store.get_stream("r/big.bin", 1) as (info, chunks):
            assert info.size == len(data) and await chunks.__anext__() == data[:CHUNK_BYTES]
            raise KeyError("the caller's own failure")
    with pytest.raises(StopAsyncIteration):
        await chunks.__anext__()


async def test_the_traits_are_declared(make_store):
    """Every backend says whether its keys are names (``flat_namespace``) and whether its clock
    is this machine's (``clock_is_local``: never before :meth:`now` fell back to it)."""
    store = await make_store()
    assert isinstance(store.flat_namespace, bool) and store.clock_is_local is False
    await store.now()
    assert store.clock_is_local is False  # a store it can write to tells its own clock


@pytest.mark.parametrize("key", [
    "checkpoints/ünïcödé/日本語.json",
    "r/emoji 😀/ß.bin",
    "with space/file name with  two spaces.json",
    "r/%41 percent+plus&amp;=?.txt",
])
async def test_unusual_key_names(make_store, key):
    store = await make_store()
    data = "héllo wörld ✓ — ünïcode".encode()
    m = meta(data)
    await store.put(key, data, m)
    got, info = await store.get(key)
    assert got == data and info.key == key and info.same_as(m)
    assert list(await listed(store)) == [key]
    assert list(await listed(store, key.split("/")[0] + "/")) == [key]
    await store.delete(key)
    assert await listed(store) == {}


async def test_stale_upload_never_replaces_newer(make_store):
    store = await make_store()
    new, old = b"new version", b"old"
    await store.put("r/s", new, meta(new, mtime_ns=1000, version=2000))
    info = await store.put("r/s", old, meta(old, mtime_ns=2000, version=1000))  # a later mtime is no version
    assert info.version == 2000 and info.sha256 == meta(new).sha256  # superseded: what is stored
    data, ginfo = await store.get("r/s")
    assert data == new and ginfo.version == 2000 and ginfo.mtime_ns == 1000
    assert [i.version for i in (await listed(store)).values()] == [2000]
    # A second store object on the same place (another sidecar) is held to the same rule.
    other = await make_store()
    info = await other.put("r/s", old, meta(old, version=1500))
    assert info.version == 2000
    assert (await store.get("r/s"))[0] == new
    # Equal or newer versions do replace it, whatever their mtime.
    newest = b"newest"
    assert (await other.put("r/s", newest, meta(newest, mtime_ns=5, version=3000))).version == 3000
    assert (await store.get("r/s"))[0] == newest
    # An object written without a version (an older release) is replaced by any versioned write.
    await store.put("r/u", old, meta(old))
    assert (await store.put("r/u", new, meta(new, mtime_ns=1, version=1))).version == 1


async def test_what_a_store_object_saw_before_decides_nothing(make_store):
    """A store keeps nothing per key: what another writer did since this store object listed or
    read a key counts, whether the caller passes no ``expected`` or a stale one."""
    a, b = await make_store(), await make_store()
    await a.put("r/k", b"five", meta(b"five", version=5))
    seen = (await listed(a))["r/k"]  # a has seen version 5
    assert (await a.get("r/k"))[1].version == 5
    await b.delete("r/k")
    await b.put("r/k", b"two", meta(b"two", version=2))  # gone, then an older version: 4 is newer
    info = await a.put("r/k", b"four", meta(b"four", version=4))
    assert info.version == 4 and (await b.get("r/k"))[0] == b"four"
    await b.delete("r/k")
    await b.put("r/k", b"one", meta(b"one", version=1))
    info = await a.put("r/k", b"three", meta(b"three", version=3), expected=seen)  # a stale belief
    assert info.version == 3 and (await b.get("r/k"))[0] == b"three"


async def test_expected_never_changes_the_outcome(make_store):
    """``put(..., expected=info)`` (what the caller last saw of the key) may make the write cheaper;
    fresh, stale or absent, the supersede rule and the swap decide by what is stored."""
    a, b = await make_store(), await make_store()
    first = await a.put("r/k", b"1", meta(b"1", version=1))
    second = await a.put("r/k", b"2", meta(b"2", version=2), expected=first)  # fresh
    assert second.version == 2 and (await b.get("r/k"))[0] == b"2"
    await b.put("r/k", b"9", meta(b"9", version=9))  # behind a's back
    refused = await a.put("r/k", b"3", meta(b"3", version=3), expected=second)  # stale: 9 stands
    assert refused.version == 9 and (await b.get("r/k"))[0] == b"9"
    assert (await a.put("r/k", b"10", meta(b"10", version=10), expected=second)).version == 10  # stale, newer
    await b.delete("r/k")
    assert (await a.put("r/k", b"11", meta(b"11", version=11), expected=refused)).version == 11  # deleted since
    current = (await b.get("r/k"))[1]
    swap = await a.put("r/k", b"x", meta(b"x", version=12), if_version=10, expected=current)
    assert swap.version == 11 and (await b.get("r/k"))[0] == b"11"  # a swap against another version: refused
    swap = await a.put("r/k", b"x", meta(b"x", version=12), if_version=11, expected=first)  # stale belief
    assert swap.version == 12 and (await b.get("r/k"))[0] == b"x"


async def test_prefix_isolation(make_store):
    a = await make_store("iso")
    b = await make_store("iso2")  # a string prefix of the other must not leak into it
    await a.put("r/k", b"from a", meta(b"from a"))
    await b.put("r/k", b"from b", meta(b"from b"))
    await b.put("r/only-b", b"b", meta(b"b"))
    assert list(await listed(a)) == ["r/k"]
    assert sorted(await listed(b)) == ["r/k", "r/only-b"]
    assert (await a.get("r/k"))[0] == b"from a"
    assert (await b.get("r/k"))[0] == b"from b"
    with pytest.raises(NotFound):
        await a.get("r/only-b")
    await a.delete("r/k")
    assert (await b.get("r/k"))[0] == b"from b"
    nested = await make_store("iso/r")
    assert await listed(nested) == {}


@pytest.mark.parametrize("key", ["../x", "/abs", "a\\b", "a//b", "a/./b", "a/../../b", "", "x/.."])
async def test_unsafe_keys_refused(make_store, key):
    store = await make_store("safe")
    with pytest.raises(StoreError) as e:
        await store.put(key, b"x", meta(b"x"))
    assert not isinstance(e.value, NotFound)
    for op in (store.get, store.delete):
        with pytest.raises(StoreError):
            await op(key)
    assert await listed(store) == {}


async def test_a_listing_comes_in_key_order(make_store, monkeypatch):
    """Every store lists in key order (Azure's lexicographic order), whatever order the objects
    were written in: a key that sorts before ``/`` (``a.txt``, ``a-b``) comes before the keys
    below ``a/``, and ``sessions`` shows the same order on every store."""
    from sidecar.store import directory

    monkeypatch.setattr(directory, "LIST_BATCH", 2)
    store = await make_store()
    keys = ["r/a/x", "r/b", "r/a.txt", "r/A", "r/a0", "r/a-b", "r/a/y/z", "r/a/y.json", "q", "s/0/1", "r/a/_"]
    for k in keys:
        await store.put(k, k.encode(), meta(k.encode()))
    assert [info.key async for info in store.list()] == sorted(keys)
    assert [info.key async for info in store.list("r/a")] == sorted(k for k in keys if k.startswith("r/a"))


async def test_a_listing_over_several_pages_or_batches_holds_each_object_once(make_store, monkeypatch):
    """Listings come in pages (Azure) or worker-thread batches (directory): made tiny here, every
    object still comes exactly once, by prefix too."""
    from sidecar.store import directory
    from sidecar.store.azure import store as azure_store

    monkeypatch.setattr(directory, "LIST_BATCH", 3)
    monkeypatch.setattr(azure_store, "FIRST_PAGE_RESULTS", 3)
    store = await make_store()
    keys = sorted([f"r/d{i % 3}/f{i}" for i in range(11)] + ["s/x", "s/y"])
    for k in keys:
        await store.put(k, k.encode(), meta(k.encode()))
    everything = [info.key async for info in store.list()]
    assert sorted(everything) == keys and len(everything) == len(keys)
    assert sorted(await listed(store, "r/d1/")) == [k for k in keys if k.startswith("r/d1/")]
