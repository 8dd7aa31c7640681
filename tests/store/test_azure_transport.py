"""The Azure store's transport reads an answer's body in large blocks."""

from __future__ import annotations

import pytest

from sidecar.store.azure import AzureBlobStore, parse_store_url
from sidecar.store.azure import store as azure_store

pytestmark = pytest.mark.anyio


async def test_the_transport_reads_large_blocks(monkeypatch):
    """An answer's body is read a quarter MiB at a time (the SDK's own default), not 4 KiB (the
    transport's default when the client is handed one: a thousand awaited reads per 4 MiB chunk)."""
    made = []

    class Spy(azure_store.AioHttpTransport):  # type: ignore[misc]
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(azure_store, "AioHttpTransport", Spy)
    store = AzureBlobStore.at(parse_store_url("http://127.0.0.1:9/devstoreaccount1/ckpt"), {"AZURE_STORAGE_KEY": "a2V5"})
    store._container_client()
    try:
        assert [t.connection_config.data_block_size >= 256 * 1024 for t in made] == [True]
    finally:
        await store.aclose()
