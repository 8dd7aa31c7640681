"""The Blob service REST calls the Azure store makes, on one pool of HTTP/1.1 connections.

Why not ``azure-storage-blob`` at run time: the store needs seven operations (List Blobs, Get
Blob, Get Blob Properties, Put Blob, Delete Blob, Create Container and nothing else), and importing
the SDK with its ``aiohttp`` transport cost 300 ms before a restore could start, 30 MiB of a
sidecar's resident memory and about 1.8 ms of client CPU per request (its generic pipeline and
deserialisers). Requests go over :mod:`sidecar.store.http11` connections. The SDK stays the
reference client of the test suite: every test reads and writes the same container with
it (``tests/store``, ``tests/faults``), so a signature, header or metadata mismatch fails there.

This module is mechanism only: requests signed for one of three authorisations (Shared Key,
SAS, Azure AD bearer token), retried with jittered exponential backoff on what retrying can fix
(connection failures, timeouts, 408/429/500/502/503/504), and failures raised as
:class:`HttpError` (the service answered) or :class:`ConnectionFailure` (it did not).
:mod:`sidecar.store.azure` gives them meaning.

Shared Key follows "Authorize with Shared Key" in the Blob service REST reference (string to sign
for version 2015-02-21 and later), exactly as the SDK's ``SharedKeyCredentialPolicy`` builds it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import random
import ssl
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import quote, unquote

import anyio

from sidecar.store import http11
from sidecar.store.proxy import Proxy

#: The REST API version every request asks for (supported by Azure and by Azurite 3.35).
API_VERSION = "2021-12-02"

#: Statuses that retrying can fix.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})

#: The scope of an Azure AD token for Blob storage.
STORAGE_SCOPE = "https://storage.azure.com/.default"


class HttpError(Exception):
    """The service answered with an unexpected status. ``code`` is its ``x-ms-error-code``."""

    def __init__(self, status: int, code: str | None) -> None:
        self.status, self.code = status, code
        super().__init__(f"{status} {code or ''}".strip())


class ConnectionFailure(Exception):
    """No answer: ``kind`` is ``dns``, ``refused``, ``timeout``, ``tls``, ``proxy`` (the proxy
    refused the tunnel; ``status`` says how) or ``failed``."""

    def __init__(self, kind: str, detail: str = "", status: int | None = None) -> None:
        self.kind, self.detail, self.status = kind, detail, status
        super().__init__(f"{kind}: {detail}" if detail else kind)


class CredentialFailure(Exception):
    """The Azure AD credential could not produce a token (no identity here, or a bad one)."""


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def metadata(self) -> dict[str, str]:
        return {k[10:]: v for k, v in self.headers.items() if k.startswith("x-ms-meta-")}


# -- authorisation ---------------------------------------------------------------------------------


class SharedKey:
    """``Authorization: SharedKey <account>:<HMAC-SHA256 of the canonical request>``."""

    def __init__(self, account: str, key: str) -> None:
        try:
            self._key = base64.b64decode(key, validate=True)
        except ValueError:
            raise ValueError("the account key is not valid base64") from None
        self.account = account

    def string_to_sign(self, method: str, path: str, query: Sequence[tuple[str, str]], headers: dict[str, str]) -> str:
        h = {k.lower(): v for k, v in headers.items()}
        length = h.get("content-length", "")
        standard = [method, h.get("content-encoding", ""), h.get("content-language", ""),
                    "" if length == "0" else length, h.get("content-md5", ""), h.get("content-type", ""),
                    h.get("date", ""), h.get("if-modified-since", ""), h.get("if-match", ""),
                    h.get("if-none-match", ""), h.get("if-unmodified-since", ""), h.get("range", "")]
        canonical_headers = "".join(f"{k}:{h[k]}\n" for k in sorted(h) if k.startswith("x-ms-"))
        # Query values here are the decoded values (they are percent-encoded only on the wire).
        resource = f"/{self.account}{path}" + "".join(f"\n{k}:{v}" for k, v in sorted((k.lower(), v) for k, v in query))
        return "\n".join(standard) + "\n" + canonical_headers + resource

    def signature(self, text: str) -> str:
        return base64.b64encode(hmac.new(self._key, text.encode("utf-8"), hashlib.sha256).digest()).decode()

    async def apply(self, method: str, path: str, query: list[tuple[str, str]], headers: dict[str, str]) -> None:
        sig = self.signature(self.string_to_sign(method, path, query, headers))
        headers["Authorization"] = f"SharedKey {self.account}:{sig}"


class SasToken:
    """A shared access signature, sent as the query of every request."""

    def __init__(self, token: str) -> None:
        self.items = [(k, unquote(v)) for k, _, v in (p.partition("=") for p in token.lstrip("?").split("&") if p)]

    async def apply(self, method: str, path: str, query: list[tuple[str, str]], headers: dict[str, str]) -> None:
        query.extend(self.items)


class BearerToken:
    """An Azure AD token from an ``azure-identity`` async credential, refreshed 5 minutes early."""

    def __init__(self, credential: Any) -> None:
        self.credential = credential
        self._token: str | None = None
        self._expires = 0.0
        self._lock = anyio.Lock()

    async def token(self) -> str:
        if self._token is None or time.time() > self._expires - 300:
            async with self._lock:
                if self._token is None or time.time() > self._expires - 300:
                    try:
                        got = await self.credential.get_token(STORAGE_SCOPE)
                    except Exception as e:  # azure-identity raises ClientAuthenticationError & co.
                        raise CredentialFailure(" ".join(str(e).split())[:200]) from None
                    self._token, self._expires = got.token, float(got.expires_on)
        return self._token

    async def apply(self, method: str, path: str, query: list[tuple[str, str]], headers: dict[str, str]) -> None:
        headers["Authorization"] = f"Bearer {await self.token()}"

    async def aclose(self) -> None:
        close = getattr(self.credential, "close", None)
        if close is not None:
            await close()


# -- the client ------------------------------------------------------------------------------------


class _Pool:
    """Keep-alive HTTP/1.1 connections (:class:`http11.Connection`) to one origin, at most
    ``size`` in use at once, the most recently used first. A connection the server closed while
    idle is known closed (the event loop tells it) and skipped; one found closed only when a
    request is sent on it (:class:`http11.StaleConnection`: no byte of an answer came) is
    replaced at once, not counted as a failure."""

    def __init__(self, base_url: str, size: int, keepalive: float = 30.0, proxy: Proxy | None = None) -> None:
        scheme, _, hostport = base_url.partition("://")
        host, port = hostport, None
        if hostport.startswith("["):
            host, _, rest = hostport[1:].partition("]")
            port = int(rest[1:]) if rest.startswith(":") else None
        elif ":" in hostport:
            host, _, p = hostport.rpartition(":")
            port = int(p)
        self._host, self._port = host, port or (443 if scheme == "https" else 80)
        self.host_header = hostport  # as in the URL: host[:port]
        self._ssl = ssl.create_default_context() if scheme == "https" else None
        self._proxy = proxy
        #: plain http through a proxy: requests name the whole URL (absolute form) and carry the
        #: proxy's credentials; https goes through a CONNECT tunnel instead
        self._absolute = f"{scheme}://{hostport}" if proxy is not None and self._ssl is None else ""
        self._proxy_headers = [("Proxy-Authorization", proxy.authorization)] \
            if self._absolute and proxy is not None and proxy.authorization else []
        self._keepalive = keepalive
        self._slots = anyio.Semaphore(size)
        self._idle: list[http11.Connection] = []

    async def request(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes,
                      connect_timeout: float, read_timeout: float) -> tuple[int, dict[str, str], bytes]:
        if self._absolute:
            target, headers = self._absolute + target, [*headers, *self._proxy_headers]
        async with self._slots:
            while True:
                conn = None
                now = time.monotonic()
                while self._idle:
                    candidate = self._idle.pop()
                    if candidate.reusable and now - candidate.idle_since < self._keepalive:
                        conn = candidate
                        break
                    candidate.close()
                reused = conn is not None
                if conn is None:
                    conn = await http11.Connection.open(self._host, self._port, self._ssl, connect_timeout, self._proxy)
                try:
                    answer = await conn.request(method, target, self.host_header, headers, body, read_timeout)
                except http11.StaleConnection:
                    conn.close()
                    if reused:
                        continue  # closed by the server as we sent (an idle timeout): at once, anew
                    raise
                except BaseException:
                    conn.close()  # whatever happened, it is never pooled again
                    raise
                if conn.reusable:
                    self._idle.append(conn)
                return answer

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def http_date(t: float | None = None) -> str:
    """An RFC 7231 date (``Sun, 06 Nov 1994 08:49:37 GMT``), in English whatever the locale; what
    ``email.utils.formatdate(usegmt=True)`` gives, without importing the ``email`` package."""
    y, mon, d, hh, mm, ss, wday, _, _ = time.gmtime(t)
    return f"{_DAYS[wday]}, {d:02d} {_MONTHS[mon - 1]} {y:04d} {hh:02d}:{mm:02d}:{ss:02d} GMT"


def backoff(attempt: int, base: float) -> float:
    """Seconds before retry ``attempt`` (1, 2, ...): ``base * 2**(attempt-1)``, capped at 30 s,
    jittered by +-50 %. With 0.5 s and 4 retries a request gives up after about 7.5 s."""
    nominal = min(base * 2 ** max(attempt - 1, 0), 30.0)
    return random.uniform(nominal * 0.5, nominal * 1.5)


def _connection_kind(e: BaseException) -> str:
    chain: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and len(chain) < 8:
        chain.append(x)
        x = x.__cause__ or x.__context__
    if any(isinstance(c, http11.ProxyRefused) for c in chain):
        return "proxy"
    if any(isinstance(c, (ssl.SSLError, ssl.CertificateError)) for c in chain):
        return "tls"
    if any(isinstance(c, OSError) and type(c).__name__ == "gaierror" for c in chain):
        return "dns"
    if any(isinstance(c, ConnectionRefusedError) for c in chain):
        return "refused"
    if any(isinstance(c, TimeoutError) for c in chain):
        return "timeout"
    text = " ".join(str(c) for c in chain).lower()
    if "name or service not known" in text or "temporary failure in name resolution" in text:
        return "dns"
    if "connection refused" in text or "errno 111" in text:
        return "refused"
    return "failed"


class BlobApi:
    """Signed, retried requests to one account's blob endpoint.

    ``base_url`` is ``scheme://host[:port]`` and ``base_path`` the account segment of a
    path-style endpoint (``/devstoreaccount1``) or ``""``. Paths passed to :meth:`request` are
    already percent-encoded and start with ``/<container>``.
    """

    def __init__(self, base_url: str, base_path: str, auth: Any, *, max_connections: int = 32,
                 retry_total: int = 4, retry_backoff: float = 0.5, connection_timeout: float = 10,
                 read_timeout: float = 60, hook: Callable[[str, str], None] | None = None,
                 proxy: Proxy | None = None) -> None:
        self.base_url, self.base_path, self.auth = base_url.rstrip("/"), base_path.rstrip("/"), auth
        self.retry_total, self.retry_backoff = retry_total, retry_backoff
        self._connect_timeout, self._read_timeout = connection_timeout, read_timeout
        self._hook = hook  # tests: called with (method, path) for every request sent
        self.proxy = proxy
        self._pool = _Pool(self.base_url, max_connections, proxy=proxy)

    def path(self, container: str, name: str | None = None) -> str:
        p = f"{self.base_path}/{container}"
        return p if name is None else f"{p}/{quote(name, safe='~/')}"

    async def request(self, method: str, path: str, query: Iterable[tuple[str, str]] = (),
                      headers: dict[str, str] | None = None, body: bytes = b"",
                      expect: Sequence[int] = (200,)) -> Response:
        """Send, retrying transient failures; the response when its status is in ``expect``.

        Raises :class:`HttpError` for any other status (after retries for transient ones),
        :class:`ConnectionFailure` when no answer came, :class:`CredentialFailure` when no token.
        """
        attempt = 0
        while True:
            try:
                response = await self._send(method, path, list(query), dict(headers or {}), body)
            except (http11.ProtocolError, TimeoutError, OSError) as e:
                status = e.status if isinstance(e, http11.ProxyRefused) else None
                failure = ConnectionFailure(_connection_kind(e), type(e).__name__, status)
                permanent = failure.kind == "tls" or status in (401, 403, 407)
                if permanent or attempt >= self.retry_total:
                    raise failure from None
            else:
                if response.status in expect:
                    return response
                error = HttpError(response.status, response.headers.get("x-ms-error-code"))
                if response.status not in TRANSIENT_STATUS or attempt >= self.retry_total:
                    raise error
            attempt += 1
            await anyio.sleep(backoff(attempt, self.retry_backoff))

    async def _send(self, method: str, path: str, query: list[tuple[str, str]], headers: dict[str, str],
                    body: bytes) -> Response:
        headers["x-ms-version"] = API_VERSION
        headers["x-ms-date"] = http_date()
        if body or method in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        await self.auth.apply(method, path, query, headers)
        target = path
        if query:
            target += "?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in query)
        if self._hook is not None:
            self._hook(method, path)
        status, fields, data = await self._pool.request(method, target, list(headers.items()), body,
                                                        self._connect_timeout, self._read_timeout)
        return Response(status, fields, data)

    async def aclose(self) -> None:
        await self._pool.aclose()
        close = getattr(self.auth, "aclose", None)
        if close is not None:
            await close()
