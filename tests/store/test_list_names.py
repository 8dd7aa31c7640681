"""A names-only listing (:func:`sidecar.listing.list_names`) gives exactly the keys the full
listing gives, on every backend (Azure through its own names-only request)."""

from __future__ import annotations

import pytest

from sidecar.listing import list_names
from sidecar.store.base import ObjectMeta

pytestmark = pytest.mark.anyio


async def test_names_only_are_the_listed_keys(make_store):
    store = await make_store("ns")
    for key in ("r/a", "r/sub/b", "r/sub/c", "s/d", ".sidecar/points/x"):
        await store.put(key, key.encode(), ObjectMeta.of(key.encode(), 1_700_000_000 * 10**9, 0o640, 0))
    for prefix in ("", "r/", "r/sub/", "zz/"):
        full = sorted([info.key async for info in store.list(prefix)])
        assert sorted([k async for k in list_names(store, prefix)]) == full
    assert sorted([k async for k in list_names(await make_store("other"))]) == []
