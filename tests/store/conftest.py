"""Fixtures for the store tests: Azurite (from ``tests/azurite.py``), a second one over TLS, and a
store factory."""

from __future__ import annotations

from typing import Any, Awaitable, Callable  # noqa: E402

import pytest  # noqa: E402
from azure.storage.blob.aio import BlobServiceClient  # noqa: E402

from sidecar.store.azure import AzureBlobStore  # noqa: E402
from sidecar.store.directory import DirectoryStore  # noqa: E402
from tests.azurite import (  # noqa: E402
    Azurite,
    AzuriteEndpoint,
    AzuriteUnavailable,
    find_azurite_command,
    self_signed_cert,
    unique_container,
)

#: Names the TLS Azurite's certificate is valid for: ``azurite`` stands for a host that only a
#: proxy can reach (it has no dot, so Azurite reads the account from the path).
TLS_HOSTS = ("127.0.0.1", "localhost", "azurite")


@pytest.fixture(scope="session")
def tls_azurite(tmp_path_factory):
    """An Azurite of its own serving https (a self-signed certificate: ``.cert``, trust it with
    ``SSL_CERT_FILE``) that also accepts bearer tokens (``--oauth basic``)."""
    try:
        find_azurite_command()
    except AzuriteUnavailable as e:
        pytest.skip(str(e))
    where = tmp_path_factory.mktemp("tls-azurite")
    cert, key = self_signed_cert(str(where), TLS_HOSTS)
    server = Azurite(str(where / "data"), cert=cert, key=key, oauth="basic").start()
    try:
        yield server
    finally:
        server.stop()


class AzureStores:
    """Makes opened AzureBlobStore objects on one fresh container; closes them and drops it."""

    def __init__(self, endpoint: AzuriteEndpoint) -> None:
        self.endpoint = endpoint
        self.container = unique_container()
        self.stores: list[AzureBlobStore] = []

    @property
    def url(self) -> str:
        return self.endpoint.container_url(self.container)

    async def __call__(self, prefix: str = "", *, url: str | None = None, env: dict | None = None,
                       open: bool = True, **options: Any) -> AzureBlobStore:
        store = AzureBlobStore.from_url(url or self.url, prefix, env=self.endpoint.env() if env is None else env, **options)
        self.stores.append(store)
        if open:
            await store.open()
        return store

    def raw(self) -> BlobServiceClient:
        """A plain SDK client on the same account, to look behind the store's back."""
        return BlobServiceClient.from_connection_string(self.endpoint.connection_string)

    async def close(self) -> None:
        for store in self.stores:
            await store.aclose()
        async with self.raw() as svc:
            try:
                await svc.delete_container(self.container)
            except Exception:  # already gone, or never made
                pass


@pytest.fixture
async def azure_stores(azurite: AzuriteEndpoint):
    stores = AzureStores(azurite)
    yield stores
    await stores.close()


@pytest.fixture(params=["directory", pytest.param("azure", marks=pytest.mark.azure)])
async def make_store(request, tmp_path) -> Callable[..., Awaitable[Any]]:
    """``await make_store(prefix="")``: an opened store of the parametrized backend.

    Every store made by one test shares one base (a directory under tmp_path, or a fresh
    container on Azurite), so two prefixes in one test live side by side.
    """
    if request.param == "directory":
        made: list[DirectoryStore] = []

        async def make(prefix: str = "") -> DirectoryStore:
            store = DirectoryStore(str(tmp_path / "store"), prefix)
            await store.open()
            made.append(store)
            return store

        yield make
        for store in made:
            await store.aclose()
    else:
        stores = AzureStores(request.getfixturevalue("azurite"))

        async def make(prefix: str = "") -> AzureBlobStore:
            return await stores(prefix)

        yield make
        await stores.close()
