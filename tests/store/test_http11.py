"""http11.Connection against real (tiny) HTTP servers on 127.0.0.1 that answer with canned bytes:
every framing the store may meet, and every way an answer can be wrong or cut short."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest

from sidecar.store import http11

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Canned:
    """Answers the n-th request on a connection with ``answers[n]`` (bytes, or None to close
    without answering); records the raw requests."""

    def __init__(self, *answers: bytes | None, then_close: bool = False) -> None:
        self.answers = answers
        self.then_close = then_close
        self.requests: list[bytes] = []
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for answer in self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + (await reader.readexactly(length) if length else b""))
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
            if not self.then_close:
                await reader.read()  # keep the connection open until the client closes it
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def connected(handler):
    """A connection to a server on 127.0.0.1 run by ``handler`` (a :class:`Canned`, or a
    ``(reader, writer)`` coroutine function); both closed on the way out. Yields (conn, port)."""
    srv = await asyncio.start_server(getattr(handler, "handle", handler), "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    conn = await http11.Connection.open("127.0.0.1", port, None, 5.0)
    try:
        yield conn, port
    finally:
        conn.close()
        srv.close()


async def one(answer: bytes, method: str = "GET", body: bytes = b"", timeout: float = 5.0, **kw):
    server = Canned(answer, **kw)
    async with connected(server) as (conn, port):
        result = await conn.request(method, "/c/b?x=1", f"127.0.0.1:{port}", [("x-ms-version", "1")], body, timeout)
        return result, conn, server


async def test_content_length_keep_alive_and_the_request_as_sent():
    (status, headers, body), conn, server = await one(
        b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\nETag: \"0x1\"\r\nX-Ms-Meta-A: b\r\n\r\nhello", "PUT", b"data")
    assert (status, body) == (201, b"hello")
    assert headers["etag"] == '"0x1"' and headers["x-ms-meta-a"] == "b"
    assert server.requests[0].startswith(b"PUT /c/b?x=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nx-ms-version: 1\r\n" in server.requests[0] and server.requests[0].endswith(b"\r\n\r\ndata")


async def test_chunked_body_with_extensions_and_trailers():
    answer = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nTrailer: x\r\n\r\n")
    (status, _, body), conn, _ = await one(answer)
    assert (status, body) == (200, b"hello world")


async def test_interim_100_is_skipped_and_head_has_no_body():
    (status, _, body), _, _ = await one(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc")
    assert (status, body) == (200, b"abc")
    (status, headers, body), conn, _ = await one(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n", "HEAD")
    assert (status, headers["content-length"], body) == (200, "1234", b"")
    assert conn.reusable is False  # closed by one(); before that it was kept


async def test_body_to_the_end_of_the_connection_is_not_kept_alive():
    (status, _, body), conn, _ = await one(b"HTTP/1.1 200 OK\r\n\r\nuntil close", then_close=True)
    assert (status, body) == (200, b"until close")


@pytest.mark.parametrize("answer, words", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "5 of 10 body bytes"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel", "closed"),
    (b"HTTP/1.1 200 OK\r\nContent-Len", "before the response headers"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
])
async def test_malformed_or_cut_short_answers_are_protocol_errors(answer, words):
    with pytest.raises(http11.ProtocolError, match=words) as e:
        await one(answer, then_close=True)
    assert not isinstance(e.value, http11.StaleConnection)  # a new connection: not "stale"


async def test_silence_is_a_timeout_and_closes_the_connection():
    server = Canned(None)  # reads the request, never answers, keeps the connection
    async with connected(server) as (conn, port):
        with pytest.raises(TimeoutError):
            await conn.request("GET", "/", "h", [], b"", 0.2)
        assert not conn.reusable


async def test_keep_alive_then_the_server_closing_an_idle_connection_is_noticed():
    server = Canned(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na", then_close=True)
    async with connected(server) as (conn, port):
        assert (await conn.request("GET", "/", "h", [], b"", 5.0))[2] == b"a"
        for _ in range(200):  # the server closes after its one answer; the loop reports it
            if not conn.reusable:
                break
            await asyncio.sleep(0.01)
        assert not conn.reusable
        with pytest.raises(http11.StaleConnection):
            await conn.request("GET", "/", "h", [], b"", 5.0)


async def test_connection_close_and_extra_bytes_end_reuse():
    (_, _, body), _conn, _ = await one(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\na")
    assert body == b"a"
    server = Canned(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\naEXTRA")
    async with connected(server) as (conn, port):
        assert (await conn.request("GET", "/", "h", [], b"", 5.0))[2] == b"a"
        assert not conn.reusable  # bytes nobody asked for: the connection is not trusted again


async def test_a_header_with_a_line_break_is_never_sent():
    server = Canned(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    async with connected(server) as (conn, port):
        with pytest.raises(ValueError, match="line break"):
            await conn.request("PUT", "/", "h", [("x-ms-meta-a", "v\r\nInjected: 1")], b"", 5.0)
        assert server.requests == []


async def test_large_bodies_both_ways():
    payload = bytes(range(256)) * 40_000  # 10 MiB: written under flow control, read in pieces

    class Echo(Canned):
        async def handle(self, reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
            data = await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
            await writer.drain()
            await reader.read()
            writer.close()

    async with connected(Echo()) as (conn, port):
        status, _, body = await conn.request("PUT", "/", "h", [("Content-Length", str(len(payload)))], payload, 5.0)
        assert status == 200 and body == payload


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (made with ``cryptography``, no network)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    d = tmp_path_factory.mktemp("tls")
    (d / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return d / "cert.pem", d / "key.pem"


async def test_https_verifies_the_server_and_carries_requests(tls_files):
    import ssl

    from sidecar.store import blobapi

    cert, key = tls_files
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    server = Canned(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=server_ctx)
    port = srv.sockets[0].getsockname()[1]
    try:
        trusting = ssl.create_default_context(cafile=str(cert))
        conn = await http11.Connection.open("127.0.0.1", port, trusting, 5.0)
        for _ in range(2):  # kept alive over TLS
            assert (await conn.request("GET", "/", f"127.0.0.1:{port}", [], b"", 5.0))[2] == b"ok"
        conn.close()
        assert server.connections == 1
        # The pool verifies against the system's CAs: a self-signed server is refused as "tls".
        api = blobapi.BlobApi(f"https://127.0.0.1:{port}", "", blobapi.SasToken("sv=1&sig=x"), retry_total=0)
        try:
            with pytest.raises(blobapi.ConnectionFailure) as e:
                await api.request("GET", "/c")
            assert e.value.kind == "tls"
        finally:
            await api.aclose()
    finally:
        srv.close()


# -- found by review: each of these failed before its fix ----------------------------------------

async def test_a_slowly_read_upload_is_progress_not_silence():
    """The inactivity timeout counts body bytes leaving, not only answer bytes arriving. (64 MiB:
    loopback's kernel buffers take about 10 MiB at once, which no client can see leave.)"""
    size = 64 * 1024 * 1024

    async def slow_reader(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        got = 0
        while got < size:  # about 2.6 s in all, never a pause near the 1 s timeout
            got += len(await reader.readexactly(min(1024 * 1024, size - got)))
            await asyncio.sleep(0.04)
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async with connected(slow_reader) as (conn, port):
        status, _, _ = await conn.request("PUT", "/", "h", [], b"x" * size, 1.0)
        assert status == 201


async def test_an_early_answer_with_the_body_unsent_is_not_pooled():
    async def refuse_early(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 413 Request Entity Too Large\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(3)  # never reads the body
        writer.close()

    async with connected(refuse_early) as (conn, port):
        status, _, _ = await conn.request("PUT", "/", "h", [], b"x" * (32 * 1024 * 1024), 5.0)
        assert status == 413 and not conn.reusable  # megabytes still queued on it: never reused


async def test_a_timeout_drops_the_connection_and_its_unsent_body_at_once():
    async def mute(reader, writer):  # reads nothing, answers nothing
        await asyncio.sleep(3)
        writer.close()

    async with connected(mute) as (conn, port):
        with pytest.raises(TimeoutError):
            await conn.request("PUT", "/", "h", [], b"x" * (32 * 1024 * 1024), 0.5)
        transport = conn._transport
        assert transport.is_closing() and transport.get_write_buffer_size() == 0  # aborted: the body is freed


async def test_a_reset_inside_a_body_read_to_its_end_is_an_error():
    import socket
    import struct

    async def reset(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npartial-body")
        await writer.drain()
        await asyncio.sleep(0.1)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async with connected(reset) as (conn, port):
        with pytest.raises(http11.ProtocolError, match="broken"):
            await conn.request("GET", "/", "h", [], b"", 5.0)


@pytest.mark.parametrize("answer", [
    "HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1"),
    "HTTP/1.1 2\u00b20 OK\r\n\r\n".encode("latin-1"),
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-3\r\nabc\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
])
async def test_only_ascii_numbers_frame_a_body(answer):
    with pytest.raises(http11.ProtocolError):
        await one(answer, then_close=True)


async def test_a_close_after_an_interim_answer_is_not_stale():
    """Bytes of an answer came (100 Continue): resending could do the request twice."""
    server = Canned(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na", b"HTTP/1.1 100 Continue\r\n\r\n", then_close=True)
    async with connected(server) as (conn, port):
        await conn.request("GET", "/", "h", [], b"", 5.0)
        with pytest.raises(http11.ProtocolError) as e:
            await conn.request("PUT", "/", "h", [], b"x", 5.0)
        assert not isinstance(e.value, http11.StaleConnection)


async def test_a_refused_request_leaves_the_connection_untouched():
    server = Canned(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na")
    async with connected(server) as (conn, port):
        with pytest.raises(ValueError):
            await conn.request("GET", "/a b", "h", [], b"", 5.0)  # a space would split the request line
        assert conn.requests == 0 and conn.reusable
        assert (await conn.request("GET", "/", "h", [], b"", 5.0))[2] == b"a"
