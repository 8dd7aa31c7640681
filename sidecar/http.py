"""Health and metrics over HTTP: ``/livez``, ``/readyz``, ``/metrics``, and the ``probe`` command.

A deliberately tiny HTTP/1.1 server on anyio (no web framework): one request per connection,
GET and HEAD only, the request head bounded to :data:`MAX_REQUEST_BYTES` and to
:data:`HEAD_TIMEOUT` seconds, every connection to :data:`CLIENT_TIMEOUT` seconds, and at most
:data:`MAX_CONNECTIONS` at once. When every slot is taken, a new connection evicts the oldest one
still waiting for its request head: probes send theirs at once and are answered within
milliseconds, so clients that hold connections open without asking (slowloris, from anywhere on
the pod network) cannot starve ``/livez`` and get the pod restarted. It runs on the daemon's event
loop but only ever reads :class:`~sidecar.health.Health` and the metrics registry, so a slow or
hostile client can hold a connection slot for a second at most, never the sync path.

    GET /livez    200 while the process works (restoring, or uploader workers and watcher alive)
    GET /readyz   200 once restored and the first reconcile is done; 503 before and while stopping.
                  While the store is failing the answer stays 200 and its body says so
                  (``ready: ...; store degraded for 12s: ...``)
    GET /metrics  Prometheus text format

``checkpoint-sidecar probe ready|live`` asks the same questions of a running sidecar and answers
with an exit code (0 ok, 1 not; 2 when no HTTP address is configured), for exec probes and
Docker ``HEALTHCHECK``.
"""

from __future__ import annotations

import errno
import re
import socket
import sys
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskGroup, TaskStatus

from sidecar import log
from sidecar.health import STARTING_PHASES, Health

if TYPE_CHECKING:
    from sidecar.config import Settings

MAX_REQUEST_BYTES = 8192  # request line + headers; we never read a body
CLIENT_TIMEOUT = 5.0  # seconds a client gets to send its request and take the answer
LINGER_SECONDS = 0.5  # after answering, how long we read and discard what a client still sends
HEAD_TIMEOUT = 1.0  # seconds a client gets to send its whole request head
MAX_CONNECTIONS = 64  # beyond this, a new connection evicts the oldest still sending its head
ACCEPT_RETRY_SECONDS = 0.1

ALLOW = "GET, HEAD"
TEXT = "text/plain; charset=utf-8"
_TOKEN = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_VERSION = re.compile(rb"^HTTP/(\d)\.(\d)$")
_REASONS = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
    503: "Service Unavailable", 505: "HTTP Version Not Supported",
}


class HttpBindError(Exception):
    """The health/metrics listener cannot be opened (port in use, address not on this host).

    The message is one line naming the address and what to change."""


# -- the checks (shared by the server and documented in docs/OPERATIONS.md) ----------------------

def liveness(health: Health) -> tuple[bool, str]:
    """Live while starting up (restore can take minutes) and, once mirroring, while the uploader
    workers and the watcher are running."""
    if health.phase in STARTING_PHASES:
        return True, f"live: {health.phase}"
    dead = [name for name, alive in (("uploader workers", health.workers_alive),
                                     ("watcher", health.watcher_alive)) if not alive]
    if dead:
        return False, f"not live: {' and '.join(dead)} stopped"
    return True, f"live: {health.phase}"


def readiness(health: Health) -> tuple[bool, str]:
    """Ready once restore is done and the first reconcile is queued; not ready again while stopping.

    A failing store (:meth:`~sidecar.health.Health.store_degraded_seconds`) does not make the
    sidecar unready: readiness gates the host's start (the startup probe), and neither restarting
    the sidecar nor taking the pod out of service fixes the store. Changes are kept, coalesced per
    path, and retried. The body says so, for people and probes that read it; alerts use
    ``checkpoint_sidecar_store_degraded``. Nor does a watcher that polls (an inotify limit used
    up): the body says so too."""
    where = f"; namespace {health.namespace}" if health.namespace else ""
    wait = health.waiting()
    if wait is not None:
        where += f"; uploads wait {wait:.0f}s more for the previous owner's write window"
    if not health.ready:
        return False, f"not ready: {health.not_ready_because}{where}" + _watch_note(health)
    degraded_seconds = health.store_degraded_seconds()
    if degraded_seconds is not None:
        where += (f"; store degraded for {int(degraded_seconds)}s: "
                  "store operations are failing and being retried, changes are kept")
    return True, f"ready: {health.reason}{where}" + _watch_note(health)


def _watch_note(health: Health) -> str:
    """``; watch degraded ...`` while the watcher polls (an inotify limit used up), else ''."""
    p = health.polling
    if p is None:
        return ""
    return f"; watch degraded for {int(time.monotonic() - p.since)}s: polling every {p.every:g}s, {p.reason}"


# -- server ---------------------------------------------------------------------------------------

def _bind_host(host: str) -> str | None:
    """``::`` (``[::]``) means every interface, IPv4 too where the host is dual-stack; anyio does
    that for ``None``. Everything else is bound as given (``0.0.0.0``: every IPv4 interface)."""
    return None if host == "::" else host


async def serve(settings: "Settings", health: Health, *,
                task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Answer from ``health`` on ``settings.http_addr`` until cancelled. ``started()`` once the
    socket is bound; raises :class:`HttpBindError` (before ``started()``) when it cannot be."""
    host_port = settings.http_host_port()
    if host_port is None:
        task_status.started()
        return
    host, port = host_port
    try:
        listener = await anyio.create_tcp_listener(local_host=_bind_host(host), local_port=port)
    except (OSError, OverflowError) as e:
        raise HttpBindError(_bind_message(settings.http_addr, e)) from None
    server = _Server(health)
    async with listener, anyio.create_task_group() as tg:
        addrs = [_fmt_addr(sub.extra(SocketAttribute.local_address)) for sub in listener.listeners]
        log.info("http_listening", addr=",".join(addrs), endpoints="/livez,/readyz,/metrics")
        for sub in listener.listeners:
            tg.start_soon(server.accept_loop, sub, tg)  # type: ignore[arg-type]  # a TCP listener's streams
        task_status.started()


def _bind_message(addr: str, e: BaseException) -> str:
    if isinstance(e, socket.gaierror):
        why = f"cannot resolve the host ({e.strerror})"
    elif isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
        why = "the port is already in use (another sidecar or process holds it)"
    elif isinstance(e, OSError) and e.errno == errno.EADDRNOTAVAIL:
        why = "the address is not one of this host's interfaces"
    elif isinstance(e, OSError) and e.errno == errno.EACCES:
        why = "permission denied (ports below 1024 need privileges)"
    elif isinstance(e, OSError) and e.strerror:
        why = e.strerror
    else:
        why = str(e)
    return (f"cannot listen on {addr} for /livez /readyz /metrics: {why}; "
            "set SIDECAR_HTTP_ADDR (--http-addr) to a free host:port, or '' to disable")


def _fmt_addr(sockaddr: tuple[Any, ...] | str) -> str:
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Server:
    def __init__(self, health: Health) -> None:
        self.health = health
        self.active = 0
        #: connections still reading their request head, oldest first (dicts keep insertion order)
        self.reading: dict[object, anyio.CancelScope] = {}

    async def accept_loop(self, listener: SocketListener, tg: TaskGroup) -> None:
        while True:
            try:
                stream = await listener.accept()
            except (OSError, anyio.BrokenResourceError) as e:  # EMFILE and friends: never end the daemon
                log.warning("http_accept_failed", error=str(e))
                await anyio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            if self.active >= MAX_CONNECTIONS:
                if not self.reading:  # every slot is answering: they are done within a moment
                    await anyio.aclose_forcefully(stream)
                    continue
                oldest = next(iter(self.reading))
                self.reading.pop(oldest).cancel()  # the oldest slow client makes room
            self.active += 1
            tg.start_soon(self.handle, stream)

    async def handle(self, stream: SocketStream) -> None:
        try:
            with anyio.move_on_after(CLIENT_TIMEOUT):
                try:
                    response = await self._exchange(stream)
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    return
                if response:
                    await _linger(stream)
        except Exception as e:  # a bug here must never reach the daemon's task group
            log.error("http_handler_failed", exc=e)
        finally:
            self.active -= 1
            with anyio.CancelScope(shield=True):
                await anyio.aclose_forcefully(stream)

    async def _exchange(self, stream: SocketStream) -> bool:
        """Read one request head and answer it. False when the client left before asking, did
        not ask within :data:`HEAD_TIMEOUT`, or was evicted for a newer connection."""
        buf = bytearray()
        token = object()
        with anyio.move_on_after(HEAD_TIMEOUT) as head_scope:
            self.reading[token] = head_scope
            try:
                while True:
                    end = _head_end(buf)
                    if end is not None:
                        break
                    if len(buf) > MAX_REQUEST_BYTES:
                        end = -1
                        break
                    try:
                        buf += await stream.receive(4096)
                    except anyio.EndOfStream:
                        return False
            finally:
                self.reading.pop(token, None)
        if head_scope.cancelled_caught or end is None:
            return False
        if end < 0:
            await stream.send(_response(431, "request head too large\n", head_only=False))
            return True
        request_line = bytes(buf[:end]).split(b"\n", 1)[0].rstrip(b"\r")
        try:
            status, body, ctype, extra, head_only = self.route(request_line)
        except Exception as e:
            log.error("http_handler_failed", exc=e)
            status, body, ctype, extra, head_only = 500, b"internal error\n", TEXT, {}, False
        await stream.send(_response(status, body, content_type=ctype, extra=extra, head_only=head_only))
        log.debug("http_request", request=request_line.decode("latin-1")[:200], status=status)
        return True

    def route(self, request_line: bytes) -> tuple[int, bytes | str, str, dict[str, str], bool]:
        parts = request_line.split(b" ")
        if len(parts) != 3 or not _TOKEN.match(parts[0]) or not parts[1]:
            return 400, "bad request\n", TEXT, {}, False
        method, target, version = parts
        v = _VERSION.match(version)
        if not v:
            return 400, "bad request\n", TEXT, {}, False
        if v.group(1) != b"1":
            return 505, "only HTTP/1.0 and HTTP/1.1\n", TEXT, {}, False
        path = urlsplit(target.decode("latin-1")).path
        handler = _ROUTES.get(path)
        if handler is None:
            return 404, f"not found; try {', '.join(_ROUTES)}\n", TEXT, {}, method == b"HEAD"
        if method not in (b"GET", b"HEAD"):
            return 405, "method not allowed\n", TEXT, {"Allow": ALLOW}, False
        status, body, ctype = handler(self)
        return status, body, ctype, {}, method == b"HEAD"

    def livez(self) -> tuple[int, bytes | str, str]:
        ok, why = liveness(self.health)
        return (200 if ok else 503), why + "\n", TEXT

    def readyz(self) -> tuple[int, bytes | str, str]:
        ok, why = readiness(self.health)
        return (200 if ok else 503), why + "\n", TEXT

    def metrics(self) -> tuple[int, bytes | str, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from sidecar import metrics  # built on first use: ``run`` starts its child sooner

        health = self.health
        metrics.READY.set(1.0 if health.ready else 0.0)
        return 200, generate_latest(metrics.REGISTRY), CONTENT_TYPE_LATEST


_ROUTES = {"/livez": _Server.livez, "/readyz": _Server.readyz, "/metrics": _Server.metrics}


def _head_end(buf: bytearray) -> int | None:
    for sep in (b"\r\n\r\n", b"\n\n"):
        i = buf.find(sep)
        if i >= 0:
            return i
    return None


def _response(status: int, body: bytes | str, *, content_type: str = TEXT,
              extra: dict[str, str] | None = None, head_only: bool = False) -> bytes:
    data = body.encode() if isinstance(body, str) else body
    headers = {
        "Content-Type": content_type,
        "Content-Length": str(len(data)),
        "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff",
        "Connection": "close",
        **(extra or {}),
    }
    head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode("latin-1") + (b"" if head_only else data)


async def _linger(stream: SocketStream) -> None:
    """Half-close, then discard what the client still sends until it closes (bounded), so the
    kernel never resets the connection under an unread request body and loses our answer."""
    await stream.send_eof()
    with anyio.move_on_after(LINGER_SECONDS):
        seen = 0
        while seen < 65536:
            try:
                seen += len(await stream.receive(4096))
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return


# -- probe ----------------------------------------------------------------------------------------

_PROBE_HOST = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def probe(settings: "Settings", what: str, timeout: float) -> int:
    """GET /readyz or /livez of the sidecar at ``settings.http_addr``; print the answer's line.

    0 when it answers 200, 1 otherwise (not ready/live, refused, no answer within ``timeout``),
    2 when no HTTP address is configured."""
    host_port = settings.http_host_port()
    if host_port is None:
        print("checkpoint-sidecar: error: probe needs the HTTP listener, but SIDECAR_HTTP_ADDR "
              "(--http-addr) is empty", file=sys.stderr)
        return 2
    host, port = host_port
    host = _PROBE_HOST.get(host, host)
    path = "/readyz" if what == "ready" else "/livez"
    url = f"http://{_fmt_addr((host, port))}{path}"
    try:
        status, body = _get(host, port, path, max(timeout, 0.001))
    except (OSError, ValueError) as e:
        why = "no answer" if isinstance(e, TimeoutError) else (getattr(e, "strerror", None) or str(e))
        print(f"not {what}: cannot reach the sidecar at {url}: {why} (timeout {timeout:g}s)")
        return 1
    line = body.decode("utf-8", "replace").strip().splitlines()
    print(line[0] if line else f"HTTP {status}")
    return 0 if status == 200 else 1


def _get(host: str, port: int, path: str, timeout: float) -> tuple[int, bytes]:
    """One plain HTTP/1.1 GET with an overall deadline; (status, body)."""
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, port), timeout=timeout) as sock:
        host_header = f"[{host}]" if ":" in host else host
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host_header}:{port}\r\n"
                     "User-Agent: checkpoint-sidecar-probe\r\nConnection: close\r\n\r\n".encode("latin-1"))
        data = bytearray()
        while len(data) < 65536:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(remaining)
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, sep, body = bytes(data).partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split(b" ")
    if not sep or len(status_line) < 2 or not status_line[1].isdigit():
        raise ValueError("not an HTTP answer")
    return int(status_line[1]), body
