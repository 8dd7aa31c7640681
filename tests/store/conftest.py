"""Fixtures for the store tests: Azurite (from ``tests/azurite.py``), a second one over TLS, and a
store factory."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, AsyncIterator, Awaitable, Callable  # noqa: E402

import pytest  # noqa: E402
from azure.storage.blob.aio import BlobServiceClient  # noqa: E402

from sidecar.store import registry  # noqa: E402
from sidecar.store.azure import AzureBlobStore  # noqa: E402
from tests.azurite import (  # noqa: E402
    Azurite,
    AzuriteEndpoint,
    AzuriteUnavailable,
    azure_store,
    find_azurite_command,
    self_signed_cert,
    unique_container,
)
from tests.memstore import MemorySpace  # noqa: E402

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
        store = azure_store(url or self.url, prefix, env=self.endpoint.env() if env is None else env, **options)
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
            with contextlib.suppress(Exception):  # already gone, or never made
                await svc.delete_container(self.container)


@pytest.fixture
async def azure_stores(azurite: AzuriteEndpoint):
    stores = AzureStores(azurite)
    yield stores
    await stores.close()


#: The backends every store test runs on (``memory``: :mod:`tests.memstore`, in this process).
BACKENDS = ["directory", pytest.param("azure", marks=pytest.mark.azure), "memory"]


def pytest_generate_tests(metafunc):
    """Parametrize ``store_place`` by :data:`BACKENDS`. A test that asks for ``store_place`` itself
    (or through a fixture of its own) wants a place another process or a command can open (a URL):
    the memory store has none, so it runs on the others only; a test that makes its stores with
    ``make_store`` alone runs on all."""
    if "store_place" not in metafunc.fixturenames:
        return
    # the test itself, or a fixture of its own other than make_store, takes the place
    takers = [metafunc.function] + [d.func for name, defs in metafunc._arg2fixturedefs.items()
                                     if name not in ("make_store", "store_place") for d in defs]
    wants_url = any("store_place" in inspect.signature(f).parameters for f in takers)
    params = [p for p in BACKENDS if not (wants_url and p == "memory")]
    metafunc.parametrize("store_place", params, indirect=True)


@pytest.fixture
async def store_place(request, tmp_path) -> AsyncIterator[tuple[Any, dict[str, str]]]:
    """Where one test's stores of the parametrized backend live: a ``SIDECAR_STORE`` URL and the
    environment (credentials) for it; for ``memory``, the :class:`~tests.memstore.MemorySpace`
    itself. A new backend is one more entry in :data:`BACKENDS` and a place here."""
    if request.param == "directory":
        yield str(tmp_path / "store"), {}
    elif request.param == "azure":
        stores = AzureStores(request.getfixturevalue("azurite"))
        yield stores.url, stores.endpoint.env()
        await stores.close()  # drops the container
    elif request.param == "memory":
        yield MemorySpace(), {}
    else:
        raise AssertionError(f"no place for the backend {request.param!r}")


@pytest.fixture
async def make_store(store_place) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """``await make_store(prefix="")``: an opened store of the parametrized backend, made the way
    the sidecar makes it (:func:`sidecar.store.registry.make_store`; a memory store on the test's
    space). Every store made by one test shares one place, so two prefixes in one test live side
    by side."""
    url, env = store_place
    made: list[Any] = []

    async def make(prefix: str = "") -> Any:
        store = url.store(prefix) if isinstance(url, MemorySpace) else registry.make_store(url, prefix, env=env)
        made.append(store)
        await store.open()
        return store

    yield make
    for store in made:
        await store.aclose()
