"""A small HTTP/1.1 client connection on an asyncio protocol: the transport under the Azure store.

The store sends a handful of request shapes to one origin, one request at a time per connection,
and reads whole bodies into memory. For that, the layers of a general client (``httpcore`` on
``h11`` on anyio streams) cost about half of a restore's client CPU: an event object per header,
a header-validation regex per line, and an anyio cancel scope around every socket read (profiled
in ``bench/RESULTS.md``). This module does only what the store needs, and checks what it reads:

* requests: ``METHOD target HTTP/1.1`` with ``Host`` and the caller's headers (no CR/LF allowed in
  any of them), the body written at once (asyncio's write buffer applies flow control);
* responses: status line and headers up to 64 KiB, bodies by ``Content-Length``, ``chunked`` or
  (without either) up to the end of the connection; none for ``HEAD``, 1xx, 204 and 304; interim
  1xx responses skipped;
* keep-alive unless ``Connection: close``, HTTP/1.0, a body read to the end of the connection, or
  anything unexpected; a server closing an idle connection is noticed by the event loop at once;
* an inactivity timeout: no byte received (and no write progress) for ``read_timeout`` seconds.

Through an HTTP proxy (:class:`~sidecar.store.proxy.Proxy`), a TLS connection is a ``CONNECT``
tunnel with TLS started inside it; a plain one is a connection to the proxy, which the caller
sends absolute-form requests on.

Errors: :class:`ProtocolError` for a malformed or cut-short answer, :class:`StaleConnection` when
a kept-alive connection is found closed (no byte of the answer came: the request can be sent
again on a new connection), :class:`ProxyRefused` when a proxy answers ``CONNECT`` with an error,
``TimeoutError``, and ``OSError`` / ``ssl.SSLError`` from connecting.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from sidecar.store.proxy import Proxy

MAX_HEAD = 64 * 1024
_NO_BODY_STATUS = frozenset({204, 304})
_DIGITS = re.compile(r"[0-9]+")
_HEX = re.compile(rb"[0-9A-Fa-f]+")


class ProtocolError(Exception):
    """The server's answer was malformed, or the connection ended in the middle of it."""


class ProxyRefused(ProtocolError):
    """The proxy answered ``CONNECT`` with a non-2xx status (407: it wants other credentials)."""

    def __init__(self, status: int, proxy: str) -> None:
        self.status = status
        super().__init__(f"the proxy {proxy} refused the tunnel: HTTP {status}")


class StaleConnection(ProtocolError):
    """A reused connection was closed before any byte of the answer came."""


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection. Use :meth:`open`, then :meth:`request` (one at a time)."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._eof = False
        self._lost: BaseException | None = None
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None
        self._received = 0  # bytes received since the current request was sent
        self.requests = 0
        self.idle_since = time.monotonic()

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buf += data
        self._received += len(data)
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._eof = True
        self._lost = exc
        self._wake()

    def resume_writing(self) -> None:
        self._wake()  # write progress counts as activity for the inactivity timeout

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- use ----------------------------------------------------------------------------------------
    @classmethod
    async def open(cls, host: str, port: int, ssl_context: ssl.SSLContext | None, timeout: float,
                   proxy: Proxy | None = None) -> "Connection":
        loop = asyncio.get_running_loop()
        if proxy is None:
            kw = {"ssl": ssl_context, "server_hostname": host, "ssl_handshake_timeout": timeout} if ssl_context else {}
            _transport, conn = await asyncio.wait_for(loop.create_connection(cls, host, port, **kw), timeout)
            return conn
        deadline = loop.time() + timeout  # one bound for reaching the proxy and the tunnel
        _transport, conn = await asyncio.wait_for(loop.create_connection(cls, proxy.host, proxy.port), timeout)
        if ssl_context is not None:
            try:
                left = max(deadline - loop.time(), 0.001)
                await asyncio.wait_for(conn._tunnel(host, port, proxy, ssl_context, left), left)
            except BaseException:
                conn.close()
                raise
        return conn

    async def _tunnel(self, host: str, port: int, proxy: Proxy, ssl_context: ssl.SSLContext, timeout: float) -> None:
        """``CONNECT host:port`` through the proxy, then TLS with ``host`` inside the tunnel."""
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
        if proxy.authorization:
            lines.append(f"Proxy-Authorization: {proxy.authorization}")
        assert self._transport is not None
        self._transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        status, _fields, _length, _chunked, _keep = await self._read_head("CONNECT", timeout, reused=False)
        if not 200 <= status < 300:
            raise ProxyRefused(status, proxy.description)
        if self._buf:
            raise ProtocolError("the proxy sent bytes of its own into the tunnel")
        loop = asyncio.get_running_loop()
        tls = await loop.start_tls(self._transport, self, ssl_context, server_hostname=host,
                                   ssl_handshake_timeout=timeout)
        if tls is None:
            raise ProtocolError("TLS could not be started inside the proxy's tunnel")
        self._transport = tls  # type: ignore[assignment]
        self._received = 0

    @property
    def reusable(self) -> bool:
        """Open, idle, and nothing pending on it either way (no byte unread, none unsent)."""
        return (not self._closed and not self._eof and not self._buf and self._transport is not None
                and self._backlog() == 0)

    def _backlog(self) -> int:
        """Bytes written but not yet handed to the kernel (a large body being sent)."""
        t = self._transport
        return t.get_write_buffer_size() if t is not None and not t.is_closing() else 0

    def close(self) -> None:
        """Drop the connection now: ``abort``, not ``close``, which would keep the socket and any
        unsent body in memory until a server that stopped reading takes it."""
        self._closed = True
        if self._transport is not None:
            self._transport.abort()

    async def _wait(self, timeout: float) -> None:
        """Until something happens on the connection; TimeoutError after ``timeout`` s in which
        nothing arrived and no byte of the request body left."""
        loop = asyncio.get_running_loop()
        fut = self._waiter = loop.create_future()
        backlog = self._backlog()

        def expire() -> None:
            nonlocal backlog, handle
            if fut.done():
                return
            left = self._backlog()
            if left < backlog:  # the body is still going out: that is progress
                backlog = left
                handle = loop.call_later(timeout, expire)
                return
            fut.set_exception(TimeoutError("no data from the server within the read timeout"))

        handle = loop.call_later(timeout, expire)
        try:
            await fut
        finally:
            handle.cancel()
            self._waiter = None

    async def request(self, method: str, target: str, host: str, headers: Sequence[tuple[str, str]],
                      body: bytes, read_timeout: float) -> tuple[int, dict[str, str], bytes]:
        """Send one request and read its whole answer: ``(status, headers, body)``, header names
        lower-cased (a repeated header keeps its last value)."""
        lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
        for part in (method, target, host):
            if any(c in part for c in "\r\n \t"):
                raise ValueError(f"request line part {part[:60]!r} cannot be sent: it holds whitespace")
        if body and not any(name.lower() == "content-length" for name, _ in headers):
            lines.append(f"Content-Length: {len(body)}")
        for name, value in headers:
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise ValueError(f"header {name!r} cannot be sent: it holds a line break (or a colon in its name)")
            lines.append(f"{name}: {value}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if self._transport is None or self._closed:
            raise StaleConnection("connection closed")
        reused = self.requests > 0
        self.requests += 1
        self._received = 0
        if body and len(body) < 65536:
            self._transport.write(head + body)
        else:
            self._transport.write(head)
            if body:
                self._transport.write(body)
        try:
            status, fields, length, chunked, keep = await self._read_head(method, read_timeout, reused)
            if length is not None:
                data = await self._read_exact(length, read_timeout)
            elif chunked:
                data = await self._read_chunked(read_timeout)
            elif method == "HEAD" or status in _NO_BODY_STATUS:
                data = b""
            else:  # no length: the body ends with the connection (a clean end, not a reset)
                while not self._eof:
                    await self._wait(read_timeout)
                if self._lost is not None:
                    raise ProtocolError(f"connection broken inside a body read to its end: {self._lost}")
                data, keep = bytes(self._buf), False
                self._buf.clear()
        except BaseException:
            self.close()
            raise
        if not keep or self._buf:  # extra bytes after the answer: never trust this connection again
            self.close()
        self.idle_since = time.monotonic()
        return status, fields, data

    async def _read_head(self, method: str, timeout: float, reused: bool):
        while True:
            end = self._buf.find(b"\r\n\r\n")
            while end < 0:
                if len(self._buf) > MAX_HEAD:
                    raise ProtocolError("response headers larger than 64 KiB")
                if self._eof:
                    if not self._received and reused:  # not one byte of an answer: safe to resend
                        raise StaleConnection("the server closed the kept-alive connection")
                    raise ProtocolError("connection closed before the response headers")
                await self._wait(timeout)
                end = self._buf.find(b"\r\n\r\n")
            head = bytes(self._buf[:end]).decode("latin-1")
            del self._buf[: end + 4]
            status_line, _, rest = head.partition("\r\n")
            version, _, tail = status_line.partition(" ")
            code = tail[:3]
            if not version.startswith("HTTP/1.") or not _DIGITS.fullmatch(code) or tail[3:4] not in ("", " "):
                raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
            status = int(code)
            fields: dict[str, str] = {}
            for line in rest.split("\r\n") if rest else ():
                name, sep, value = line.partition(":")
                if not sep or not name or name != name.strip():
                    raise ProtocolError(f"malformed header line: {line[:80]!r}")
                fields[name.lower()] = value.strip()
            if 100 <= status < 200:
                continue  # interim answer (100 Continue): the real one follows
            keep = version == "HTTP/1.1" and "close" not in fields.get("connection", "").lower()
            chunked = "chunked" in fields.get("transfer-encoding", "").lower()
            length = None
            if method == "HEAD" or status in _NO_BODY_STATUS:
                length = 0
            elif not chunked and "content-length" in fields:
                raw = fields["content-length"]
                if not _DIGITS.fullmatch(raw):
                    raise ProtocolError(f"bad Content-Length {raw[:40]!r}")
                length = int(raw)
            return status, fields, length, chunked, keep

    async def _read_exact(self, n: int, timeout: float) -> bytes:
        while len(self._buf) < n:
            if self._eof:
                raise ProtocolError(f"connection closed after {len(self._buf)} of {n} body bytes")
            await self._wait(timeout)
        if len(self._buf) == n:
            data = bytes(self._buf)
            self._buf.clear()
        else:
            data = bytes(self._buf[:n])
            del self._buf[:n]
        return data

    async def _read_line(self, timeout: float) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            if self._eof:
                raise ProtocolError("connection closed inside a chunked body")
            if len(self._buf) > MAX_HEAD:
                raise ProtocolError("chunk header too long")
            await self._wait(timeout)
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    async def _read_chunked(self, timeout: float) -> bytes:
        parts = []
        while True:
            size_field = (await self._read_line(timeout)).split(b";", 1)[0].strip()
            if not _HEX.fullmatch(size_field) or len(size_field) > 16:
                raise ProtocolError(f"bad chunk size {size_field[:20]!r}")
            size = int(size_field, 16)
            if size == 0:
                while await self._read_line(timeout):  # trailers, up to the empty line
                    pass
                return b"".join(parts)
            parts.append(await self._read_exact(size, timeout))
            if await self._read_line(timeout):
                raise ProtocolError("chunk not followed by CRLF")

