"""blobapi's connection handling against a real (tiny) HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.store import blobapi

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class DropsSecondRequest:
    """Answers the first request on each connection and keeps it open; a second request on the
    same connection is read and then the connection is closed with no answer, as a load
    balancer does when its idle timeout fires while the client sends."""

    def __init__(self) -> None:
        self.connections = 0
        self.answered = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            self.answered += 1
            await reader.readuntil(b"\r\n\r\n")  # the reuse: dropped unanswered
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_kept_alive_connection_closed_by_the_server_is_replaced_at_once():
    server = DropsSecondRequest()
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    # retry_total=0: the request can only succeed through the immediate replacement, not a retry
    api = blobapi.BlobApi(f"http://127.0.0.1:{port}", "", blobapi.SasToken("sv=1&sig=x"), retry_total=0)
    try:
        for _ in range(3):
            response = await api.request("GET", "/ckpt")
            assert (response.status, response.body) == (200, b"ok")
        assert server.answered == 3 and server.connections == 3
    finally:
        await api.aclose()
        srv.close()
        await srv.wait_closed()


async def test_a_new_connection_failing_is_not_retried_without_retries():
    async def hang_up(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    srv = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    api = blobapi.BlobApi(f"http://127.0.0.1:{port}", "", blobapi.SasToken("sv=1&sig=x"), retry_total=0)
    try:
        with pytest.raises(blobapi.ConnectionFailure):
            await api.request("GET", "/ckpt")
    finally:
        await api.aclose()
        srv.close()
        await srv.wait_closed()


@pytest.mark.parametrize("t", [0, 784111777, 951782400.5, 1709164800, 1796061181.9, 4102444799])
def test_http_date_is_what_email_utils_writes(t):
    from email.utils import formatdate

    assert blobapi.http_date(t) == formatdate(t, usegmt=True)
