"""The store registry: a SIDECAR_STORE value is parsed once, by the backend its scheme names, and
every problem with it is one ``SIDECAR_STORE: ...`` line of the configuration."""

from __future__ import annotations

import pytest

from sidecar.config import ConfigError, load
from sidecar.store import registry
from sidecar.store.azure import AzureBlobStore

pytestmark = pytest.mark.anyio

KEY_ENV = {"AZURE_STORAGE_KEY": "a2V5" * 22}


@pytest.mark.parametrize("url, words", [
    ("https://acct.blob.core.windows.net", "names no container"),
    ("https://acct.blob.core.windows.net/Bad_Name", "container name 'Bad_Name' is invalid"),
    ("https://storage.example.com/ckpt", "cannot tell the storage account"),
    ("https://acct.blob.core.windows.net/ckpt?foo=bar", "not a SAS"),
    ("ftp://acct/ckpt", "unsupported store URL scheme 'ftp'"),
    ("file://host/x", "names the host 'host'"),
])
def test_a_bad_store_url_is_one_config_line(url, words, tmp_path):
    """Whatever the backend finds wrong, it is said by the configuration, naming the variable."""
    with pytest.raises(ConfigError) as e:
        load({}, cwd=str(tmp_path), env={"SIDECAR_STORE": url})
    assert len(e.value.problems) == 1, e.value.problems
    assert e.value.problems[0].startswith("SIDECAR_STORE: ") and words in e.value.problems[0], e.value.problems


def test_the_configuration_parses_the_url_once_and_make_store_does_not_again(tmp_path, monkeypatch):
    import sidecar.store.azure as backend

    calls = []
    real = backend.parse_url
    monkeypatch.setattr(backend, "parse_url", lambda url, env: calls.append(url) or real(url, env))
    settings, _ = load({}, cwd=str(tmp_path), env={"SIDECAR_STORE": "https://acct.blob.core.windows.net/ckpt/base"})
    assert isinstance(settings.store, registry.StoreURL) and settings.store == "https://acct.blob.core.windows.net/ckpt/base"
    assert settings.store_url.backend.name == "azure" and settings.store_url.local_path is None
    assert len(calls) == 1
    store = registry.make_store(settings.store_url, "ns", env=KEY_ENV)
    assert len(calls) == 1 and isinstance(store, AzureBlobStore) and store.prefix == "base/ns"


def test_a_directory_store_is_local(tmp_path):
    settings, _ = load({}, cwd=str(tmp_path), env={"SIDECAR_STORE": f"file://{tmp_path}/s"})
    assert settings.store_url.backend.name == "directory" and settings.store_url.local_path == f"{tmp_path}/s"


@pytest.mark.parametrize("concurrency, pool", [(16, 32), (3, 6), (100, 200)])
async def test_make_store_sizes_the_azure_connection_pool_from_the_concurrency(concurrency, pool):
    store = registry.make_store("https://acct.blob.core.windows.net/ckpt", concurrency=concurrency, env=KEY_ENV)
    try:
        store._container_client()  # the SDK client and its aiohttp session, made on first use
        session = store._service._config.transport.session
        assert session.connector.limit == pool
    finally:
        await store.aclose()


def test_every_scheme_names_one_backend():
    schemes = [s for b in registry.BACKENDS for s in b.schemes]
    assert len(schemes) == len(set(schemes))
    for backend in registry.BACKENDS:
        module = backend.load()
        assert callable(module.parse_url) and callable(module.make), backend.name
