"""The store through an HTTP proxy: which proxy the environment picks (pure), and real CONNECT
tunnels and absolute-form requests through a small proxy on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64

import pytest

from sidecar.store import blobapi, http11
from sidecar.store.proxy import Proxy, bypassed, proxy_for
from tests.store.test_http11 import tls_files  # noqa: F401  (a fixture)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


# -- which proxy -------------------------------------------------------------------------------

def test_the_scheme_picks_the_variable_and_lower_case_wins():
    env = {"HTTPS_PROXY": "http://upper:3128", "https_proxy": "http://lower:3128", "HTTP_PROXY": "plain:8080"}
    assert proxy_for("https", "acct.blob.core.windows.net", 443, env) == Proxy("lower", 3128)
    assert proxy_for("http", "azurite.internal", 10000, env) == Proxy("plain", 8080)
    assert proxy_for("https", "acct.blob.core.windows.net", 443, {}) is None
    assert proxy_for("https", "h", 443, {"HTTPS_PROXY": "http://p"}).port == 80


def test_credentials_become_basic_authorization_and_never_a_message():
    p = proxy_for("https", "h", 443, {"HTTPS_PROXY": "http://us%40er:p%3Ass@proxy.corp:3128"})
    assert p.authorization == "Basic " + base64.b64encode(b"us@er:p:ss").decode()
    assert "p:ss" not in repr(p) and "us@er" not in repr(p) and p.description == "proxy.corp:3128"
    with pytest.raises(ValueError) as e:
        proxy_for("https", "h", 443, {"HTTPS_PROXY": "socks5://user:s3cret@proxy:1080"})
    assert "only http://" in str(e.value) and "s3cret" not in str(e.value)
    for bad in ("http://user:s3cret@proxy:notaport", "http://user:p[s3cret]@proxy:3128",
                "http://user:12345/s3cret@proxy:3128", "http://user:s3cret@proxy:3128/?q#f"):
        with pytest.raises(ValueError) as e:
            proxy_for("https", "h", 443, {"HTTPS_PROXY": bad})
        assert "percent-encode" in str(e.value) and "s3cret" not in str(e.value) and "12345" not in str(e.value)


def test_an_empty_lower_case_variable_turns_the_proxy_off():
    assert proxy_for("https", "h", 443, {"https_proxy": "", "HTTPS_PROXY": "http://p:1"}) is None
    assert proxy_for("https", "h", 443, {"HTTPS_PROXY": "http://p:1", "HTTP_PROXY": "socks5://x"}) == Proxy("p", 1)


ACCOUNT = "acct.blob.core.windows.net"


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
    assert bypassed(host, port, no_proxy) is direct


# -- through a proxy ---------------------------------------------------------------------------

class TinyProxy:
    """Answers CONNECT by piping to the named host (or refusing with ``refuse``); answers any
    other request itself, as the origin would, recording what it was sent."""

    def __init__(self, refuse: int | None = None) -> None:
        self.refuse = refuse
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head)
            method, target, _ = head.split(b"\r\n", 1)[0].decode().split(" ")
            if self.refuse:
                writer.write(f"HTTP/1.1 {self.refuse} No\r\nContent-Length: 2\r\n\r\nno".encode())
            elif method == "CONNECT":
                host, _, port = target.rpartition(":")
                up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")

                async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
                    while data := await src.read(65536):
                        dst.write(data)
                        await dst.drain()
                    dst.close()

                await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
                await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def serve(handler, **kw):
    srv = await asyncio.start_server(handler, "127.0.0.1", 0, **kw)
    return srv, srv.sockets[0].getsockname()[1]


async def test_https_goes_through_a_connect_tunnel_with_tls_to_the_origin_inside(tls_files, monkeypatch):  # noqa: F811
    import ssl

    cert, key = tls_files
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    seen_by_origin: list[bytes] = []

    async def origin(reader, writer):
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                seen_by_origin.append(head)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecret")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    tiny = TinyProxy()
    origin_srv, origin_port = await serve(origin, ssl=server_ctx)
    proxy_srv, proxy_port = await serve(tiny.handle)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the pool trusts the system CAs, here this one
    api = blobapi.BlobApi(f"https://127.0.0.1:{origin_port}", "", blobapi.SasToken("sv=1&sig=x"), retry_total=0,
                          proxy=Proxy("127.0.0.1", proxy_port, "Basic dTpw"))
    try:
        for _ in range(2):  # the tunnel is kept alive like any connection
            assert (await api.request("GET", "/c")).body == b"secret"
    finally:
        await api.aclose()
        origin_srv.close()
        proxy_srv.close()
    assert len(tiny.heads) == 1
    assert tiny.heads[0].startswith(f"CONNECT 127.0.0.1:{origin_port} HTTP/1.1\r\n".encode())
    assert b"Proxy-Authorization: Basic dTpw\r\n" in tiny.heads[0]
    # inside the tunnel: the origin got both requests, and never the proxy's credentials
    assert len(seen_by_origin) == 2 and all(h.startswith(b"GET /c?") for h in seen_by_origin)
    assert not any(b"Proxy-Authorization" in h for h in seen_by_origin)


async def test_plain_http_sends_absolute_form_requests_to_the_proxy():
    tiny = TinyProxy()
    proxy_srv, proxy_port = await serve(tiny.handle)
    api = blobapi.BlobApi("http://azurite.internal:10000", "/devstoreaccount1", blobapi.SasToken("sv=1&sig=x"),
                          retry_total=0, proxy=Proxy("127.0.0.1", proxy_port, "Basic dTpw"))
    try:
        assert (await api.request("GET", api.path("c"))).body == b"ok"
    finally:
        await api.aclose()
        proxy_srv.close()
    head = tiny.heads[0].decode()
    assert head.startswith("GET http://azurite.internal:10000/devstoreaccount1/c?")
    assert "\r\nHost: azurite.internal:10000\r\n" in head and "\r\nProxy-Authorization: Basic dTpw\r\n" in head


async def test_a_proxy_refusing_the_tunnel_is_one_permanent_line_without_its_password():
    from sidecar.store.azure import AzureBlobStore
    from sidecar.store.base import StoreError, TransientStoreError

    tiny = TinyProxy(refuse=407)
    proxy_srv, proxy_port = await serve(tiny.handle)
    store = AzureBlobStore.from_url(
        "https://acct.blob.core.windows.net/state",
        env={"AZURE_STORAGE_KEY": base64.b64encode(b"k" * 32).decode(),
             "HTTPS_PROXY": f"http://me:s3cret@127.0.0.1:{proxy_port}"},
        retry_total=3, retry_backoff=5.0)  # a retry would make this test take seconds
    try:
        with pytest.raises(StoreError) as e:
            await store.open()
    finally:
        await store.aclose()
        proxy_srv.close()
    assert not isinstance(e.value, TransientStoreError)
    message = str(e.value)
    assert f"proxy 127.0.0.1:{proxy_port} refused" in message and "407" in message
    assert "s3cret" not in message and "\n" not in message
    assert len(tiny.heads) == 1  # not retried


async def test_connect_answered_with_an_error_is_proxy_refused():
    tiny = TinyProxy(refuse=502)
    proxy_srv, proxy_port = await serve(tiny.handle)
    import ssl

    try:
        with pytest.raises(http11.ProxyRefused) as e:
            await http11.Connection.open("example.invalid", 443, ssl.create_default_context(), 5.0,
                                         Proxy("127.0.0.1", proxy_port))
    finally:
        proxy_srv.close()
    assert e.value.status == 502


async def test_an_unreachable_proxy_is_named_as_such():
    import socket

    from sidecar.store.azure import AzureBlobStore
    from sidecar.store.base import StoreError

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = AzureBlobStore.from_url(
        "https://acct.blob.core.windows.net/state",
        env={"AZURE_STORAGE_KEY": base64.b64encode(b"k" * 32).decode(), "HTTPS_PROXY": f"127.0.0.1:{port}"},
        retry_total=0)
    try:
        with pytest.raises(StoreError) as e:
            await store.open()
    finally:
        await store.aclose()
    assert f"connection refused for the proxy 127.0.0.1:{port}" in str(e.value) and "HTTPS_PROXY" in str(e.value)
