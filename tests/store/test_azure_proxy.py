"""The Azure store through an HTTP proxy: which proxy the environment picks (pure), and real
requests through tests/proxy.py on 127.0.0.1, in absolute form for http and in a CONNECT tunnel,
TLS inside, for https. The store's host is ``azurite``, which does not resolve here: only the proxy
can reach it (it forwards to Azurite whatever host the request names)."""

from __future__ import annotations

import base64
import os
import socket

import anyio
import pytest

from sidecar.store.base import ObjectMeta, StoreError, TransientStoreError
from sidecar.store.proxy import Proxy, _bypassed, proxy_for
from support import disk_tree, run_cli, sidecar_env
from tests.azurite import DEV_ACCOUNT, DEV_KEY, azure_store, unique_container
from tests.proxy import Proxy as ForwardProxy

pytestmark = pytest.mark.anyio

ACCOUNT = "acct.blob.core.windows.net"
FAKE_KEY = base64.b64encode(b"k" * 64).decode()


# -- which proxy -------------------------------------------------------------------------------

def test_the_scheme_picks_the_variable_and_lower_case_wins():
    env = {"HTTPS_PROXY": "http://upper:3128", "https_proxy": "http://lower:3128", "HTTP_PROXY": "plain:8080"}
    assert proxy_for("https", ACCOUNT, 443, env).url == "http://lower:3128"
    assert proxy_for("http", "azurite.internal", 10000, env).url == "http://plain:8080"
    assert proxy_for("https", ACCOUNT, 443, {}) is None
    assert proxy_for("https", "h", 443, {"HTTPS_PROXY": "http://p"}).port == 80


def test_credentials_stay_in_the_url_and_out_of_every_message():
    p = proxy_for("https", "h", 443, {"HTTPS_PROXY": "http://us%40er:p%3Ass@proxy.corp:3128"})
    assert p.url == "http://us%40er:p%3Ass@proxy.corp:3128" and p.description == "proxy.corp:3128"
    assert "p:ss" in p.secrets and "p%3Ass" in p.secrets
    assert "p%3Ass" not in repr(p) and "us%40er" not in repr(p)
    with pytest.raises(ValueError) as e:
        proxy_for("https", "h", 443, {"HTTPS_PROXY": "socks5://user:s3cret@proxy:1080"})
    assert "only http://" in str(e.value) and "s3cret" not in str(e.value)
    for bad in ("http://user:s3cret@proxy:notaport", "http://user:p[s3cret]@proxy:3128",
                "http://user:12345/s3cret@proxy:3128", "http://user:s3cret@proxy:3128/?q#f"):
        with pytest.raises(ValueError) as e:
            proxy_for("https", "h", 443, {"HTTPS_PROXY": bad})
        assert "percent-encode" in str(e.value) and "s3cret" not in str(e.value) and "12345" not in str(e.value)


def test_an_unusable_proxy_variable_is_refused_even_for_a_bypassed_host():
    with pytest.raises(ValueError):
        azure_store("http://127.0.0.1:10000/devstoreaccount1/ckpt",
                    env={"AZURE_STORAGE_KEY": FAKE_KEY, "HTTP_PROXY": "socks5://p:1"})


def test_an_empty_lower_case_variable_turns_the_proxy_off():
    assert proxy_for("https", "h", 443, {"https_proxy": "", "HTTPS_PROXY": "http://p:1"}) is None
    assert proxy_for("https", "h", 443, {"HTTPS_PROXY": "http://p:1", "HTTP_PROXY": "socks5://x"}).url == "http://p:1"


@pytest.mark.parametrize("host,port,no_proxy,direct", [
    ("127.0.0.1", 10000, "", True),  # loopback and localhost: never proxied
    ("::1", 10000, "", True),
    ("localhost", 10000, "", True),
    (ACCOUNT, 443, "", False),
    (ACCOUNT, 443, "*", True),
    (ACCOUNT, 443, "core.windows.net", True),
    (ACCOUNT, 443, ".windows.net", True),
    (ACCOUNT, 443, "*.windows.net", True),
    (ACCOUNT, 443, "indows.net", False),  # a suffix of the name, not a domain
    (ACCOUNT, 443, "other.example, acct.blob.core.windows.net:443", True),
    (ACCOUNT, 443, "acct.blob.core.windows.net:8443", False),
    ("10.1.2.3", 443, "10.0.0.0/8", True),
    ("10.1.2.3", 443, "192.168.0.0/16,10.1.2.4", False),
    ("fd00::5", 443, "fd00::/16", True),
    ("fd00::5", 443, "[fd00::5]:443", True),
    ("fd00::5", 443, "[fd00::5]:8443", False),
    ("Acct.Blob.Core.Windows.Net.", 443, " ,, CORE.WINDOWS.NET. ,", True),
])
def test_no_proxy(host, port, no_proxy, direct):
    assert _bypassed(host, port, no_proxy) is direct


def test_the_store_takes_the_proxy_for_its_endpoint_once():
    env = {"AZURE_STORAGE_KEY": FAKE_KEY, "HTTPS_PROXY": "http://proxy.corp:3128", "NO_PROXY": "other.example"}
    assert azure_store(f"https://{ACCOUNT}/ckpt", env=env)._proxy == Proxy("proxy.corp", 3128, "http://proxy.corp:3128")
    assert azure_store(f"https://{ACCOUNT}/ckpt", env={**env, "NO_PROXY": ".windows.net"})._proxy is None


# -- through a proxy ---------------------------------------------------------------------------

@pytest.fixture
def forward_proxy():
    proxies: list[ForwardProxy] = []

    def start(upstream_port: int) -> ForwardProxy:
        proxies.append(ForwardProxy("127.0.0.1", upstream_port).start())
        return proxies[-1]

    yield start
    for p in proxies:
        p.stop()


@pytest.mark.azure
async def test_plain_http_goes_through_the_proxy_with_its_credentials(azurite, azure_stores, forward_proxy):
    port = int(azurite.url.split(":")[2].split("/")[0])
    proxy = forward_proxy(port)
    env = {"AZURE_STORAGE_ACCOUNT": DEV_ACCOUNT, "AZURE_STORAGE_KEY": DEV_KEY,
           "HTTP_PROXY": f"http://us%40er:s3cret@127.0.0.1:{proxy.port}"}
    store = await azure_stores("p", url=f"http://azurite:{port}/{DEV_ACCOUNT}/{azure_stores.container}", env=env)
    data = b"through the proxy"
    await store.put("r/k", data, ObjectMeta.of(data, 1, 0o600))
    assert (await store.get("r/k"))[0] == data
    assert [i.key async for i in store.list()] == ["r/k"]
    await store.delete("r/k")
    methods = [r.method for r in proxy.records if r.action == "forwarded"]
    assert methods[:1] == ["GET"] and {"PUT", "DELETE"} <= set(methods)  # the open's listing first
    assert all(r.path.startswith(f"/{DEV_ACCOUNT}/{azure_stores.container}") for r in proxy.records)
    assert proxy.proxy_auth and set(proxy.proxy_auth) == {"Basic " + base64.b64encode(b"us@er:s3cret").decode()}


@pytest.mark.azure
def test_https_goes_through_a_connect_tunnel_with_tls_to_the_account_inside(tls_azurite, forward_proxy, tmp_path):
    """The real sidecar (``restore``) reaches the TLS Azurite only through the tunnel; the proxy
    sees the CONNECT and its credentials, never a request inside."""
    from azure.core.credentials import AzureNamedKeyCredential
    from azure.storage.blob.aio import BlobServiceClient

    container = unique_container("tunnel")
    files = {"ctx/a.json": b"a" * 100, "ctx/b.json": os.urandom(3000)}

    async def seed() -> None:
        async with BlobServiceClient(tls_azurite.url, credential=AzureNamedKeyCredential(DEV_ACCOUNT, DEV_KEY),
                                     connection_verify=tls_azurite.cert) as svc:
            c = await svc.create_container(container)
            for rel, data in files.items():
                await c.upload_blob(f".checkpoints/{rel}", data)

    anyio.run(seed)
    proxy = forward_proxy(tls_azurite.port)
    env = {k: v for k, v in sidecar_env().items() if not k.startswith("AZURE_") and "proxy" not in k.lower()}
    env.update(AZURE_STORAGE_ACCOUNT=DEV_ACCOUNT, AZURE_STORAGE_KEY=DEV_KEY, SSL_CERT_FILE=tls_azurite.cert,
               HTTPS_PROXY=f"http://me:s3cret@127.0.0.1:{proxy.port}", SIDECAR_LOG_LEVEL="debug")
    work = tmp_path / "work"
    work.mkdir()
    r = run_cli("restore", "--store", f"https://azurite:{tls_azurite.port}/{DEV_ACCOUNT}/{container}", cwd=work, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert disk_tree(work / ".checkpoints") == files
    assert proxy.connects and all(c == f"CONNECT azurite:{tls_azurite.port} HTTP/1.1" for c in proxy.connects)
    assert set(proxy.proxy_auth) == {"Basic " + base64.b64encode(b"me:s3cret").decode()}
    assert not proxy.records  # everything else went inside the tunnel
    assert "s3cret" not in r.stdout + r.stderr


async def test_a_proxy_refusing_the_tunnel_is_one_permanent_line_without_its_password(forward_proxy):
    proxy = forward_proxy(9)
    proxy.refuse_connect = 407
    store = azure_store(f"https://{ACCOUNT}/state",
                        env={"AZURE_STORAGE_KEY": FAKE_KEY, "HTTPS_PROXY": f"http://me:s3cret@127.0.0.1:{proxy.port}"},
                        retry_total=3, retry_backoff=5.0)  # a retry would make this test take seconds
    try:
        with pytest.raises(StoreError) as e:
            await store.open()
    finally:
        await store.aclose()
    assert not isinstance(e.value, TransientStoreError)
    message = str(e.value)
    assert f"proxy 127.0.0.1:{proxy.port} refused" in message and "407" in message
    assert "s3cret" not in message and "\n" not in message
    assert len(proxy.connects) == 1  # not retried


async def test_an_unreachable_proxy_is_named_as_such():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = azure_store(f"https://{ACCOUNT}/state",
                        env={"AZURE_STORAGE_KEY": FAKE_KEY, "HTTPS_PROXY": f"127.0.0.1:{port}"}, retry_total=0)
    try:
        with pytest.raises(StoreError) as e:
            await store.open()
    finally:
        await store.aclose()
    assert f"connection refused for the proxy 127.0.0.1:{port}" in str(e.value) and "HTTPS_PROXY" in str(e.value)
