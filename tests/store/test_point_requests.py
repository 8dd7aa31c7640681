"""The requests a restore of 2,000 files makes, from a restore point and without one: counted at the
store interface on both stores, and as HTTP requests to Azurite (through tests/proxy.py)."""

from __future__ import annotations

import os
from collections import Counter

import anyio
import pytest

from sidecar.paths import Root
from sidecar.restore.latest import restore
from sidecar.store.base import ObjectMeta
from tests.azurite import AzuriteEndpoint
from tests.pointkit import Counting, write_point
from tests.proxy import Proxy

pytestmark = pytest.mark.anyio
#: request counts: the rule on the memory store in the fast suite, the real stores in CI's second tier
FAST_BACKENDS = ("memory",)

#: 2,000 files (the issue's figure) in the full run; 300 (two listing pages on Azure) in the fast one
SIZES = pytest.mark.parametrize("files", [300, pytest.param(2000, marks=pytest.mark.nightly)])  # the same rule, at scale


async def seed(store, files: int) -> None:
    limit = anyio.Semaphore(32)

    async def one(i: int) -> None:
        data = os.urandom(4096)
        async with limit:
            await store.put(f".checkpoints/s{i % 20}/{i}.json", data, ObjectMeta.of(data, 1, 0o600, i + 1))

    async with anyio.create_task_group() as tg:
        for i in range(files):
            tg.start_soon(one, i)


@SIZES
async def test_a_fast_restore_of_2000_files_is_a_few_requests(make_store, tmp_path, files):
    store = await make_store()
    await seed(store, files)
    await write_point(store, 10**6)
    counting = Counting(store)
    _, result = await restore(counting, [Root(".checkpoints", str(tmp_path / "fast" / ".checkpoints"))])
    assert result.files == result.from_points == files
    ops = Counter(op for op, _ in counting.calls)
    # the namespace's listing, the points' listing, the point, the root's (absent) snapshot bundle
    assert ops == {"list": 2, "get": 2}, counting.calls

    await store.delete(".sidecar/points/0000000000001000000-full.tar")
    counting = Counting(store)
    _, result = await restore(counting, [Root(".checkpoints", str(tmp_path / "per-file" / ".checkpoints"))])
    assert result.files == files and result.from_points == 0
    assert Counter(op for op, _ in counting.calls) == {"list": 2, "get": files + 1}


@pytest.mark.azure
@pytest.mark.slow  # the real store's requests: CI's second tier
@SIZES
async def test_http_requests_of_a_fast_restore_on_azure(azure_stores, azurite, tmp_path, files):
    with Proxy.before(azurite.url) as proxy:
        via = AzuriteEndpoint(proxy.via(azurite.url))
        store = await azure_stores(url=via.container_url(azure_stores.container), env=via.env())
        await seed(store, files)
        await write_point(store, 10**6)
        proxy.records.clear()
        _, result = await restore(store, [Root(".checkpoints", str(tmp_path / "fast" / ".checkpoints"))])
        fast_seconds = result.seconds
        assert result.from_points == files
        fast = Counter(r.method for r in proxy.records)
        # 2 listing pages (250 blobs, then the rest) + 1 of the points; the point in ranged GETs of
        # 4 MiB (2,000 files: 3 of them, 9.8 MB); the bundle's 404
        assert fast["GET"] <= 8 and sum(fast.values()) == fast["GET"], fast

        await store.delete(".sidecar/points/0000000000001000000-full.tar")
        proxy.records.clear()
        _, result = await restore(store, [Root(".checkpoints", str(tmp_path / "per-file" / ".checkpoints"))])
        assert Counter(r.method for r in proxy.records)["GET"] >= files
        print(f"\n{files} files: from a point {dict(fast)} in {fast_seconds:.2f} s; per file "
              f"{dict(Counter(r.method for r in proxy.records))} in {result.seconds:.2f} s (through the proxy)")
