"""A small HTTP/1.1 fault-injection proxy on 127.0.0.1, for putting in front of Azurite.

It understands just enough HTTP to act per request: it reads one request (head and a body framed by
``Content-Length`` or ``chunked``), then, by the knobs the test sets,

* ``latency``: waits that long before forwarding (a slow store, as the client sees it),
* ``fail_with``: answers with these statuses in turn (e.g. ``[503, 429]``) instead of forwarding;
  the request never reaches the store, exactly like a throttling front end,
* ``hold``: keeps every request waiting until released; a request whose client gives up (closes
  the connection) meanwhile is dropped, never forwarded,
* ``hold_if``: the same for the requests a predicate picks (given the request's :class:`Record`),
  e.g. every DELETE: a gate at an exact point of the sidecar's work, not a race against a timer,

and otherwise forwards it on a connection of its own to the upstream and relays the response
(``Content-Length``, ``chunked``, bodiless, or read to close). Every request is recorded in
:attr:`Proxy.records` (method, path, request ``x-ms-meta-*`` headers, status, what was done).

It is also a forward proxy, as ``HTTP_PROXY`` / ``HTTPS_PROXY`` point clients at one: an
absolute-form request (``GET http://host/...``) is forwarded in origin form without its
``Proxy-Authorization``, and ``CONNECT host:port`` opens a tunnel to the upstream (or is refused
with ``refuse_connect``); :attr:`Proxy.connects` records the CONNECT lines and
:attr:`Proxy.proxy_auth` every ``Proxy-Authorization`` sent. Whatever host the client names, the
upstream is the one given: the proxy stands in for DNS as well.

It runs its own asyncio loop on a thread, so tests and sidecar processes can use it from anywhere;
the knobs are plain attributes, safe to set from the test thread.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import unquote, urlsplit

HOP_HEADERS = {"connection", "keep-alive", "proxy-connection"}
ERROR_CODES = {503: "ServerBusy", 429: "TooManyRequests", 500: "InternalError"}
REASONS = {503: "Service Unavailable", 429: "Too Many Requests", 500: "Internal Server Error"}


@dataclass
class Record:
    """One request as the proxy handled it."""

    method: str
    path: str  # URL path, percent-decoded, without the query
    query: str
    headers: dict[str, str]  # request headers, names lower-case
    action: str  # "forwarded", "failed", "dropped"
    status: int | None = None  # what the client got (None when dropped)
    t: float = field(default_factory=time.monotonic)

    @property
    def blob(self) -> str:
        """The blob name for ``/<account>/<container>/<blob>`` paths ('' otherwise)."""
        parts = self.path.lstrip("/").split("/", 2)
        return parts[2] if len(parts) == 3 else ""

    @property
    def stamp(self) -> int | None:
        """The sidecar's version of a write (``x-ms-meta-sidecar_version``), if any."""
        v = self.headers.get("x-ms-meta-sidecar_version")
        return int(v) if v else None


class _ClientGone(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if e.partial.strip():
            raise ConnectionError("truncated head") from None
        return None


def _parse_headers(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers.append((k.strip(), v.strip()))
    return lines[0], headers


def _get(headers: list[tuple[str, str]], name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


async def _read_body(reader: asyncio.StreamReader, headers: list[tuple[str, str]], *,
                     bodiless: bool, to_close: bool) -> bytes:
    """The raw body bytes as framed on the wire (chunked bodies kept chunked)."""
    if bodiless:
        return b""
    te = (_get(headers, "transfer-encoding") or "").lower()
    if "chunked" in te:
        out = bytearray()
        while True:
            line = await reader.readuntil(b"\r\n")
            out += line
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:  # trailers, up to the empty line
                    t = await reader.readuntil(b"\r\n")
                    out += t
                    if t == b"\r\n":
                        return bytes(out)
            out += await reader.readexactly(size + 2)
    length = _get(headers, "content-length")
    if length is not None:
        return await reader.readexactly(int(length))
    if to_close:
        return await reader.read()
    return b""


class Proxy:
    """``Proxy(upstream_host, upstream_port).start()``; ``url`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.latency = 0.0
        self.fail_with: list[int] = []
        self.hold = False
        self.hold_if: Callable[[Record], bool] | None = None
        self.refuse_connect: int | None = None  # answer CONNECT with this status instead of tunnelling
        self.records: list[Record] = []
        self.connects: list[str] = []  # CONNECT request lines
        self.proxy_auth: list[str] = []  # Proxy-Authorization values received
        self._fail_cycle = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._conns: set[asyncio.StreamWriter] = set()
        self.port = 0

    @classmethod
    def before(cls, url: str) -> "Proxy":
        """A started proxy in front of the server of ``url`` (``http://host:port/...``)."""
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 80).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def via(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's."""
        parts = urlsplit(url)
        return parts._replace(netloc=f"127.0.0.1:{self.port}").geturl()

    # -- knobs ----------------------------------------------------------------------------------
    def set(self, *, latency: float | None = None, fail_with: list[int] | None = None,
            hold: bool | None = None, hold_if: Callable[[Record], bool] | None = None) -> None:
        if latency is not None:
            self.latency = latency
        if fail_with is not None:
            self.fail_with = list(fail_with)
        if hold is not None:
            self.hold = hold
        if hold_if is not None:
            self.hold_if = hold_if

    def count(self, action: str | None = None, status: int | None = None, method: str | None = None) -> int:
        return sum(1 for r in list(self.records)
                   if (action is None or r.action == action) and (status is None or r.status == status)
                   and (method is None or r.method == method))

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Proxy":
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        loop = self._loop

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._conns):
                w.close()
            # end the per-connection handlers while the loop still runs (closing the loop under
            # them leaves coroutines whose cleanup fails later, in the garbage collector)
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in handlers:
                t.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), loop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None

    def __enter__(self) -> "Proxy":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = loop.run_until_complete(asyncio.start_server(self._client, sock=sock))
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    # -- per connection -------------------------------------------------------------------------
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head = await _read_head(reader)
                if head is None:
                    return
                request_line, headers = _parse_headers(head)
                method, target, version = request_line.split(" ", 2)
                auth = _get(headers, "proxy-authorization")
                if auth is not None:
                    self.proxy_auth.append(auth)
                if method == "CONNECT":
                    await self._tunnel(request_line, reader, writer)
                    return
                if target.startswith(("http://", "https://")):  # absolute form: as a forward proxy
                    origin = urlsplit(target)
                    target = origin.path + (f"?{origin.query}" if origin.query else "")
                    headers = [(k, v) for k, v in headers if k.lower() != "proxy-authorization"]
                    head = (f"{method} {target} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
                            + "\r\n").encode("latin-1")
                body = await _read_body(reader, headers, bodiless=False, to_close=False)
                parts = urlsplit(target)
                rec = Record(method, unquote(parts.path), parts.query,
                             {k.lower(): v for k, v in headers if k.lower().startswith("x-ms-meta-")}, "")
                self.records.append(rec)
                try:
                    await self._wait(reader, rec)
                except _ClientGone:
                    rec.action = "dropped"
                    return
                if self.fail_with:
                    status = self.fail_with[next(self._fail_cycle) % len(self.fail_with)]
                    rec.action, rec.status = "failed", status
                    writer.write(self._error(status))
                    await writer.drain()
                    continue
                if up is None:
                    up = await asyncio.open_connection(*self.upstream)
                up[1].write(head + body)
                await up[1].drain()
                resp_head = await _read_head(up[0])
                if resp_head is None:
                    raise ConnectionError("upstream closed")
                status_line, resp_headers = _parse_headers(resp_head)
                status = int(status_line.split(" ", 2)[1])
                closing = (_get(resp_headers, "connection") or "").lower() == "close"
                bodiless = method == "HEAD" or status in (204, 304) or 100 <= status < 200
                resp_body = await _read_body(up[0], resp_headers, bodiless=bodiless, to_close=closing)
                rec.action, rec.status = "forwarded", status
                writer.write(resp_head + resp_body)
                await writer.drain()
                if closing:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            return
        finally:
            self._conns.discard(writer)
            for w in (writer, up[1] if up else None):
                if w is not None:
                    w.close()

    async def _tunnel(self, request_line: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """``CONNECT``: a byte pipe to the upstream, or the refusal the test asked for."""
        self.connects.append(request_line)
        if self.refuse_connect is not None:
            writer.write(f"HTTP/1.1 {self.refuse_connect} Refused\r\nContent-Length: 0\r\n\r\n".encode())
            await writer.drain()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def _wait(self, reader: asyncio.StreamReader, rec: Record) -> None:
        """Apply latency, hold and hold_if; raise _ClientGone when the client closed meanwhile."""
        deadline = time.monotonic() + self.latency
        while self.hold or (self.hold_if is not None and self.hold_if(rec)) or time.monotonic() < deadline:
            if reader.at_eof():
                raise _ClientGone()
            await asyncio.sleep(min(0.01, max(0.0, deadline - time.monotonic())) or 0.01)
        if reader.at_eof():
            raise _ClientGone()

    @staticmethod
    def _error(status: int) -> bytes:
        code = ERROR_CODES.get(status, "InternalError")
        body = (f'<?xml version="1.0" encoding="utf-8"?><Error><Code>{code}</Code>'
                f"<Message>injected by the test proxy</Message></Error>").encode()
        head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\n"
                f"Content-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
                f"x-ms-error-code: {code}\r\n\r\n")
        return head.encode("latin-1") + body
