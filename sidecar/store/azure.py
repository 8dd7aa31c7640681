"""The Azure Blob store: one container, an optional prefix, block blobs with our metadata.

``SIDECAR_STORE`` names the container and an optional prefix, in either form::

    https://<account>.blob.core.windows.net/<container>[/<prefix>]       host style (Azure)
    http://127.0.0.1:10000/<account>/<container>[/<prefix>]             path style (Azurite)

Path style applies when the host is an IP address or ``localhost``, or when the first path segment
is the account named by the connection string (or ``AZURE_STORAGE_ACCOUNT``). ``SIDECAR_PREFIX``
nests below the URL's prefix.

Credentials, first match wins (none is ever logged or shown in an error):
``AZURE_STORAGE_CONNECTION_STRING`` (its endpoint replaces the URL's; container and prefix still
come from the URL), ``AZURE_STORAGE_KEY``, a SAS token (``AZURE_STORAGE_SAS_TOKEN`` or the URL's
query), else ``DefaultAzureCredential`` (``AZURE_CLIENT_ID`` picks a user-assigned identity; see
:func:`_token_credential` for the sources it tries).

Every request goes through ``azure-storage-blob`` (``azure.storage.blob.aio``): one
``BlobServiceClient`` per store on one aiohttp session whose connection pool is sized to the
store's concurrency. The proxy comes from ``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``NO_PROXY`` (see
:func:`proxy_for`), read once. ``docs/AZURE-STORE.md`` gives the reasons.

Each object is one block blob whose metadata carries ``sidecar_sha256``, ``sidecar_mtime_ns``,
``sidecar_mode`` and ``sidecar_version``. ``sidecar_version`` (never a clock) orders writes in the conditional-write rule
that keeps a stale upload from replacing a newer one (see :meth:`AzureBlobStore.put`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import logging
import os
import random
import re
import ssl
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, AsyncIterator, Callable, Iterable, Mapping
from urllib.parse import unquote, urlsplit

import aiohttp
from azure.core import MatchConditions
from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
)
from azure.core.pipeline.transport import AioHttpTransport
from azure.storage.blob import ContentSettings
from azure.storage.blob.aio import BlobServiceClient, ContainerClient, ExponentialRetry

from sidecar import log
from sidecar.paths import MAX_KEY_BYTES, UnsafeKey, validate_relpath
from sidecar.store.base import CHUNK_BYTES, NotFound, ObjectInfo, ObjectMeta, Source, StoreError, TransientStoreError, supersedes

# Metadata names must be valid C# identifiers; Azure treats them case-insensitively.
META_SHA256 = "sidecar_sha256"
META_MTIME = "sidecar_mtime_ns"
META_MODE = "sidecar_mode"
META_VERSION = "sidecar_version"

#: Mode reported for blobs that carry no sidecar metadata (written by something else).
FOREIGN_MODE = 0o600

#: How often put re-reads and retries when concurrent writers keep changing the blob.
MAX_CONFLICT_ROUNDS = 8
#: Blobs in the listing's first page (``open()`` fetches it). Small, so that a restore starts
#: downloading early while the next, full-size pages are fetched.
FIRST_PAGE_RESULTS = 250
#: Blobs in every other listing page (the service's maximum).
PAGE_RESULTS = 5000
#: Blobs up to this size go up in one Put Blob; larger ones in blocks of CHUNK_BYTES and a conditional
#: commit, so memory stays bounded whatever the size.
MAX_SINGLE_PUT_SIZE = 8 * 1024 * 1024

#: The longest ``Retry-After`` a retry waits for; a longer one is the sidecar's own retry's business.
RETRY_AFTER_MAX = 30.0
#: The scope of an Azure AD token for Blob storage.
STORAGE_SCOPE = "https://storage.azure.com/.default"
#: Statuses that retrying can fix (the SDK retries 408 and 5xx itself; 429 reaches the sidecar).
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: What a connection failure of each kind is called in a message.
_FAILED = {"dns": "cannot resolve the host", "refused": "connection refused", "timeout": "timed out"}

_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
_CONTAINER_RE = re.compile(r"^(?=.{3,63}$)[a-z0-9](?:-?[a-z0-9])*$")
_HOST_STYLE_RE = re.compile(r"^(?P<account>[a-z0-9]{3,24})\.(?:privatelink\.)?blob\.", re.IGNORECASE)
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


# ---------------------------------------------------------------------------------------------
# Redaction
# ---------------------------------------------------------------------------------------------

_REDACT_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # Connection-string fields and query parameters holding secrets: AccountKey=..., sig=...
    (
        re.compile(
            r"(?i)\b(AccountKey|SharedAccessSignature|SharedAccessKey|sig|signature|client_secret|"
            r"password|pwd|access_token|refresh_token|token)=([^;&\s'\",]+)"
        ),
        r"\1=***",
    ),
    # Authorization header values.
    (re.compile(r"(?i)\b(Bearer)\s+[A-Za-z0-9._~+/=-]+"), r"\1 ***"),
    (re.compile(r"(?i)\b(SharedKey(?:Lite)?)\s+([^:\s]+):\S+"), r"\1 \2:***"),
    # JWTs (Azure AD tokens) wherever they appear.
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"), "***"),
    # A bare storage account key: 64 random bytes are 88 base64 characters ending in '=='.
    (re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{86}=="), "***"),
]


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every known secret and anything shaped like a credential replaced by ``***``.

    ``secrets`` are exact values to remove (keys, SAS tokens, connection strings), also in their
    URL-decoded form; the patterns catch ``AccountKey=``, ``sig=``, ``Bearer``/``SharedKey``
    authorization values, JWTs and bare account keys even when the value is not known.
    """
    out = str(text)
    known: set[str] = set()
    for s in secrets:
        if s and len(s) >= 6:
            known.add(s)
            known.add(unquote(s))
    for s in sorted(known, key=len, reverse=True):
        out = out.replace(s, "***")
    for pattern, repl in _REDACT_PATTERNS:
        out = pattern.sub(repl, out)
    return out


def _quoted_etag(etag: str | None) -> str | None:
    """ETags as the service sends them in headers (quoted); listings give them bare."""
    if not etag:
        return None
    return etag if etag.startswith(('"', 'W/"')) else f'"{etag}"'


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# URL and credentials
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlobLocation:
    """Where a store URL points. ``endpoint`` is the account's blob endpoint, without query."""

    scheme: str
    netloc: str
    account: str
    container: str
    prefix: str  # "" or "a/b", no leading or trailing slash
    path_style: bool
    sas: str | None  # the URL's query when it is a SAS token

    @property
    def endpoint(self) -> str:
        base = f"{self.scheme}://{self.netloc}"
        return f"{base}/{self.account}" if self.path_style else base


def _is_ip_or_localhost(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _join_prefix(*parts: str, what: str) -> str:
    segments: list[str] = []
    for part in parts:
        part = part.strip("/")
        if "//" in part:
            raise ValueError(f"bad {what}: empty segment in {part[:60]!r}")
        segments.extend(s for s in part.split("/") if s)
    if any(s.startswith(".") for s in segments):  # would reach roots or the sidecar's own objects
        raise ValueError(f"bad {what}: a segment must not start with '.'")
    prefix = "/".join(segments)
    if prefix:
        try:
            validate_relpath(prefix)
        except UnsafeKey as e:
            raise ValueError(f"bad {what}: {e}") from None
    return prefix


def parse_store_url(url: str, prefix: str = "", known_account: str | None = None) -> BlobLocation:
    """Split a ``SIDECAR_STORE`` URL into account, container and prefix; ValueError if malformed.

    ``prefix`` (``SIDECAR_PREFIX``) nests below the URL's own prefix. ``known_account`` (from a
    connection string or ``AZURE_STORAGE_ACCOUNT``) lets a custom host use path style.
    """
    form = (
        "expected https://<account>.blob.core.windows.net/<container>[/<prefix>] or "
        "http://127.0.0.1:10000/<account>/<container>[/<prefix>]"
    )
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a bad port
    except ValueError:
        raise ValueError(f"store URL is not a valid URL; {form}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"store URL scheme must be https (or http for an emulator); {form}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("store URL must not contain a user name or password; use the AZURE_STORAGE_* variables")
    if parts.fragment:
        raise ValueError(f"store URL must not contain a #fragment; {form}")
    host = (parts.hostname or "").lower()
    if not host:
        raise ValueError(f"store URL has no host; {form}")
    sas = None
    if parts.query:
        if "sig=" not in parts.query:
            raise ValueError(
                "store URL has a query that is not a SAS token (a SAS has sv=...&sig=...); "
                "remove it or pass the SAS in AZURE_STORAGE_SAS_TOKEN"
            )
        sas = parts.query
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc = f"{netloc}:{port}"
    if "//" in parts.path.rstrip("/").lstrip("/"):
        raise ValueError("bad store URL: an empty path segment ('//')")
    segments = [unquote(s) for s in parts.path.split("/") if s]

    m = _HOST_STYLE_RE.match(host)
    if _is_ip_or_localhost(host):
        path_style = True
    elif m is not None:
        path_style = False
    elif known_account and segments and segments[0] == known_account:
        path_style = True
    else:
        raise ValueError(
            f"cannot tell the storage account from host {host!r}: use "
            "https://<account>.blob.core.windows.net/<container>, or a path-style URL "
            "http(s)://<host>/<account>/<container> together with a connection string or "
            "AZURE_STORAGE_ACCOUNT naming that account"
        )
    if path_style:
        if not segments:
            raise ValueError(f"store URL names no account and container; {form}")
        account, segments = segments[0], segments[1:]
    else:
        assert m is not None  # host style: the host matched
        account = m.group("account").lower()
    if not _ACCOUNT_RE.match(account):
        raise ValueError(f"storage account name {account!r} is invalid (3-24 lowercase letters and digits)")
    if not segments:
        raise ValueError(f"store URL names no container; {form}")
    container = segments[0]
    if not _CONTAINER_RE.match(container):
        raise ValueError(
            f"container name {container!r} is invalid: 3-63 lowercase letters, digits and "
            "single hyphens, starting and ending with a letter or digit"
        )
    full_prefix = _join_prefix("/".join(segments[1:]), what="prefix in store URL")
    full_prefix = _join_prefix(full_prefix, prefix, what="SIDECAR_PREFIX")
    return BlobLocation(scheme, netloc, account, container, full_prefix, path_style, sas)


def _connection_string_fields(conn: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for item in conn.split(";"):
        if "=" in item:
            k, v = item.split("=", 1)
            fields[k.strip().lower()] = v.strip()
    return fields


#: The emulator's documented development account, for ``UseDevelopmentStorage=true``.
_DEV_ACCOUNT = "devstoreaccount1"
_DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@dataclass
class _Credentials:
    source: str  # "connection string" | "account key" | "SAS token" | "DefaultAzureCredential"
    secrets: tuple[str, ...]
    #: what the SDK client is given: AzureNamedKeyCredential, AzureSasCredential or an async
    #: token credential (which this store made and closes)
    credential: Any
    endpoint: str | None = None  # scheme://host[:port][/account] from a connection string
    account: str | None = None

    @property
    def owned(self) -> Any:
        """The token credential to close with the store, if any."""
        return self.credential if self.source == "DefaultAzureCredential" else None

    def hint(self, account: str) -> str:
        return {
            "connection string":
                "check AZURE_STORAGE_CONNECTION_STRING (AccountName/AccountKey or SAS) is current for this account",
            "account key": f"check AZURE_STORAGE_KEY is a current access key of account {account!r}",
            "SAS token":
                "check the SAS token is for this account and container, has not expired (se=) and the clock is right",
            "DefaultAzureCredential":
                "check the pod's managed or workload identity (AZURE_CLIENT_ID for a user-assigned one) and its token",
        }[self.source]


def _account_key(account: str, key: str, what: str) -> AzureNamedKeyCredential:
    try:
        base64.b64decode(key, validate=True)
    except (ValueError, binascii.Error):
        raise ValueError(f"{what} is not an account key (base64)") from None
    return AzureNamedKeyCredential(account, key)


def _from_connection_string(conn: str) -> _Credentials:
    f = _connection_string_fields(conn)
    bad = "AZURE_STORAGE_CONNECTION_STRING is not a usable storage connection string"
    if f.get("usedevelopmentstorage", "").lower() == "true":
        f.setdefault("accountname", _DEV_ACCOUNT)
        f.setdefault("accountkey", _DEV_KEY)
        f.setdefault("blobendpoint", f"http://127.0.0.1:10000/{_DEV_ACCOUNT}")
    account = f.get("accountname")
    endpoint = f.get("blobendpoint", "").rstrip("/")
    if not endpoint and account:
        scheme = f.get("defaultendpointsprotocol", "https").lower()
        endpoint = f"{scheme}://{account}.blob.{f.get('endpointsuffix', 'core.windows.net')}"
    if not endpoint:
        raise ValueError(f"{bad}: it names neither BlobEndpoint nor AccountName")
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018  (raises ValueError for a bad port)
    except ValueError:
        raise ValueError(f"{bad}: BlobEndpoint must be an http(s) URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{bad}: BlobEndpoint must be an http(s) URL")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{bad}: BlobEndpoint must not contain a user name or password")
    if not account:
        m = _HOST_STYLE_RE.match(parts.hostname)
        account = m.group("account") if m else (parts.path.strip("/").split("/")[0] or None)
    if not account:
        raise ValueError(f"{bad}: it has no AccountName")
    secrets = tuple(s for s in (conn, f.get("accountkey"), f.get("sharedaccesssignature")) if s)
    if f.get("accountkey"):
        credential: Any = _account_key(account, f["accountkey"], f"{bad}: its AccountKey")
    elif f.get("sharedaccesssignature"):
        credential = AzureSasCredential(f["sharedaccesssignature"].lstrip("?"))
    else:
        raise ValueError(f"{bad}: it has neither AccountKey nor SharedAccessSignature")
    return _Credentials("connection string", secrets, credential, endpoint=endpoint, account=account)


#: The ``exclude_*`` flags of :func:`_token_credential`: the developer-tool sources of
#: DefaultAzureCredential, which a sidecar has no use for (they look for az, pwsh, azd, VS Code
#: and a shared token cache on the host).
_DEVELOPER_SOURCES = ("shared_token_cache", "visual_studio_code", "cli", "developer_cli", "powershell")


def _token_credential(env: Mapping[str, str], timeout: float) -> Any:
    """``azure.identity.aio.DefaultAzureCredential`` for a host without key or SAS.

    Unless ``AZURE_TOKEN_CREDENTIALS`` chooses otherwise (azure-identity's own switch: ``dev``,
    ``prod`` or one credential's name), only the production sources are tried, in the SDK's
    order: the environment's service principal (``AZURE_TENANT_ID``, ``AZURE_CLIENT_ID``,
    ``AZURE_CLIENT_SECRET``/certificate), workload identity (``AZURE_FEDERATED_TOKEN_FILE``) and
    managed identity (``IDENTITY_ENDPOINT`` + ``IDENTITY_HEADER`` on Container Apps and App
    Service, else the instance metadata service). Token requests time out after ``timeout``
    seconds, are not retried after a timeout and at most three times after a 5xx, so a broken
    identity endpoint is one clear error within seconds rather than minutes.
    Only this function imports azure-identity.
    """
    from azure.identity.aio import DefaultAzureCredential

    options: dict[str, Any] = {"connection_timeout": timeout, "read_timeout": timeout,
                               "retry_total": 3, "retry_read": 0}
    client_id = env.get("AZURE_CLIENT_ID") or None
    if client_id:
        options["managed_identity_client_id"] = client_id
    if not env.get("AZURE_TOKEN_CREDENTIALS", "").strip():
        options.update({f"exclude_{name}_credential": True for name in _DEVELOPER_SOURCES})
    try:
        return DefaultAzureCredential(**options)
    except ValueError as e:  # an AZURE_TOKEN_CREDENTIALS value it does not know
        raise ValueError(_one_line(str(e), 240)) from None


def _pick_credentials(env: Mapping[str, str], account: str, url_sas: str | None, scheme: str,
                      timeout: float = 10.0) -> _Credentials:
    conn = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    if conn:
        try:
            return _from_connection_string(conn)
        except ValueError as e:
            raise ValueError(redact(str(e), [conn])) from None
    key = env.get("AZURE_STORAGE_KEY", "").strip()
    if key:
        return _Credentials("account key", (key,), _account_key(account, key, "AZURE_STORAGE_KEY"))
    sas = env.get("AZURE_STORAGE_SAS_TOKEN", "").strip().lstrip("?") or (url_sas or "").lstrip("?")
    if sas:
        if "sig=" not in sas:
            raise ValueError("AZURE_STORAGE_SAS_TOKEN does not look like a SAS token (it has no sig=)")
        secrets = tuple(s for s in (sas, *re.findall(r"sig=([^&]+)", sas)) if s)
        return _Credentials("SAS token", secrets, AzureSasCredential(sas))
    if scheme != "https":
        raise ValueError("an Azure AD token (DefaultAzureCredential) is only sent over https; use an "
                         "https store URL, or AZURE_STORAGE_CONNECTION_STRING / AZURE_STORAGE_KEY for an emulator")
    return _Credentials("DefaultAzureCredential", (), _token_credential(env, timeout))


# ---------------------------------------------------------------------------------------------
# Proxy
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proxy:
    """The HTTP proxy a store's requests go through. ``url`` may hold credentials: a secret."""

    host: str
    port: int
    url: str = field(repr=False)
    secrets: tuple[str, ...] = field(default=(), repr=False)

    @property
    def description(self) -> str:
        """``host:port``, for messages: never the credentials."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _proxy_env(env: Mapping[str, str], name: str) -> str:
    """The lower-case variable if set (even empty: that turns the proxy off, as in urllib), else
    the upper-case one."""
    lower = name.lower()
    return (env[lower] if lower in env else env.get(name.upper(), "")).strip()


def proxy_for(scheme: str, host: str, port: int, env: Mapping[str, str]) -> Proxy | None:
    """The proxy for ``scheme://host:port``, or None to connect directly.

    ``HTTPS_PROXY`` (``https_proxy``) for https, ``HTTP_PROXY`` (``http_proxy``) for http; the
    lower-case name wins when both are set, as in curl. ``NO_PROXY`` (``no_proxy``) lists hosts
    reached directly: ``*``, a host name (which also covers its subdomains; a leading ``.`` or
    ``*.`` means the same), an IP address or a CIDR network, each optionally with ``:port``.
    Loopback and ``localhost`` are never proxied. Only ``http://`` proxies; credentials in the URL
    become ``Proxy-Authorization: Basic``. ``ValueError`` (one line, no credentials) for a proxy
    URL that cannot be used, whichever host it would be for.
    """
    name = "https_proxy" if scheme == "https" else "http_proxy"
    url = _proxy_env(env, name)
    if not url:
        return None
    proxy = _parse_proxy(name, url)
    return None if _bypassed(host, port, _proxy_env(env, "no_proxy")) else proxy


def _parse_proxy(name: str, url: str) -> Proxy:
    unusable = (f"{name.upper()} is not an http://[user:password@]host[:port] URL "
                "(percent-encode special characters in the user name and password)")
    try:  # no message of urlsplit's is shown: it could quote part of the password
        parts = urlsplit(url if "://" in url else f"http://{url}")
        scheme, host, port = parts.scheme.lower(), parts.hostname, parts.port or 80
    except ValueError:
        raise ValueError(unusable) from None
    if scheme != "http":
        raise ValueError(f"{name.upper()}: only http:// proxies are supported (got {scheme}://)")
    if not host or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(unusable)
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    secrets: tuple[str, ...] = ()
    if parts.username is not None:
        user, password = parts.username, parts.password or ""
        secrets = tuple(s for s in (password, unquote(password), url) if s)
        netloc = f"{user}:{password}@{netloc}"
    return Proxy(host, port, f"http://{netloc}", secrets)


def _bypassed(host: str, port: int, no_proxy: str) -> bool:
    """True when ``host`` is reached directly: loopback, or matched by ``no_proxy``."""
    host = host.strip("[]").lower().rstrip(".")
    try:
        address: Any = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if host == "localhost" or host.endswith(".localhost") or (address is not None and address.is_loopback):
        return True
    for entry in no_proxy.split(","):
        entry = entry.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return True
        entry, entry_port = _split_port(entry)
        if entry_port is not None and entry_port != port:
            continue
        entry = entry.strip("[]")
        if address is not None:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        entry = entry.removeprefix("*").lstrip(".").rstrip(".")
        if entry and (host == entry or host.endswith("." + entry)):
            return True
    return False


def _split_port(entry: str) -> tuple[str, int | None]:
    """``host:port`` / ``[v6]:port`` → (host, port); a bare IPv6 address or CIDR keeps its colons."""
    if entry.startswith("["):
        inside, _, rest = entry[1:].partition("]")
        return inside, int(rest[1:]) if rest[1:].isdigit() else None
    if entry.count(":") == 1:
        name, _, port = entry.partition(":")
        if port.isdigit():
            return name, int(port)
    return entry, None


# ---------------------------------------------------------------------------------------------
# Failures and retries
# ---------------------------------------------------------------------------------------------


def _code(e: BaseException) -> str | None:
    """The storage error code (``BlobNotFound``...) of an SDK exception, as a plain string."""
    code = getattr(e, "error_code", None)
    code = getattr(code, "value", code)
    return str(code) if code else None


def _cause_chain(e: BaseException) -> list[BaseException]:
    """``e`` and what it wraps: causes, contexts, the SDK's ``inner_exception``, aiohttp's ``os_error``."""
    seen: set[int] = set()
    out: list[BaseException] = []
    todo: list[Any] = [e]
    while todo and len(out) < 16:
        x = todo.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        out.append(x)
        todo.extend([getattr(x, "inner_exception", None), getattr(x, "os_error", None), x.__cause__, x.__context__])
    return out


def _failure(e: BaseException) -> tuple[str, int | None]:
    """What kind of connection failure ``e`` is: ``proxy`` (the proxy refused the tunnel, with its
    status), ``tls``, ``dns``, ``refused``, ``timeout`` or ``failed``."""
    chain = _cause_chain(e)
    for x in chain:
        if isinstance(x, aiohttp.ClientHttpProxyError):
            return "proxy", x.status
    if any(isinstance(x, (ssl.SSLError, ssl.CertificateError, aiohttp.ClientSSLError)) for x in chain):
        return "tls", None
    if any(isinstance(x, aiohttp.ClientConnectorDNSError) or type(x).__name__ == "gaierror" for x in chain):
        return "dns", None
    if any(isinstance(x, ConnectionRefusedError) for x in chain):
        return "refused", None
    if any(isinstance(x, TimeoutError) or "Timeout" in type(x).__name__ for x in chain):
        return "timeout", None
    text = " ".join(str(x) for x in chain).lower()
    if "name or service not known" in text or "temporary failure in name resolution" in text:
        return "dns", None
    if "connection refused" in text or "errno 111" in text:
        return "refused", None
    return "failed", None


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds the service asked to wait (``Retry-After``, or its millisecond forms), if any."""
    for name, scale in (("retry-after-ms", 0.001), ("x-ms-retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value:
            try:
                return max(float(value) * scale, 0.0)
            except ValueError:
                continue  # an HTTP date: the exponential schedule applies
    return None


class _Retry(ExponentialRetry):
    """The SDK's storage retry policy (it retries connection errors, timeouts, 408 and 5xx;
    not 429, which the sidecar's own retry takes) with this schedule: the ``Retry-After`` of
    the failed answer when it has one (at most :data:`RETRY_AFTER_MAX`), else ``base * 2**(n-1)``
    seconds jittered by +-50 % and capped at 30 s; with 0.5 s and 4 retries a request gives up
    after about 7.5 s. Not retried: TLS failures, a proxy refusing the tunnel (401/403/407) and a
    credential that could not get a token (azure-identity retries its own requests).
    """

    def __init__(self, base: float, retry_total: int) -> None:
        super().__init__(initial_backoff=0, increment_base=2, retry_total=retry_total, random_jitter_range=0,
                         retry_connect=retry_total, retry_read=retry_total, retry_status=retry_total)
        self.base = base

    def get_backoff_time(self, settings: dict[str, Any]) -> float:
        history = settings.get("history") or []
        response = getattr(history[-1], "http_response", None) if history else None
        after = _retry_after(response.headers) if response is not None else None
        if after is not None:
            return min(after, RETRY_AFTER_MAX)
        nominal = min(self.base * 2 ** max(settings["count"] - 1, 0), 30.0)
        return random.uniform(nominal * 0.5, nominal * 1.5)

    def increment(self, settings: dict[str, Any], request: Any, response: Any = None,
                  error: AzureError | None = None) -> bool:
        if isinstance(error, ClientAuthenticationError):
            return False  # the credential could not get a token: it has retried on its own
        if error is not None:
            kind, status = _failure(error)
            if kind == "tls" or (kind == "proxy" and status in (401, 403, 407)):
                return False
        return super().increment(settings, request, response=response, error=error)


def _credential_reason(e: BaseException) -> str:
    """The line of an azure-identity failure that says why: the last credential the chain tried."""
    text = str(getattr(e, "message", None) or e)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    tried = [line for line in lines if re.match(r"^\w+Credential: ", line)]
    return _one_line(tried[-1] if tried else (lines[0] if lines else type(e).__name__), 240)


def _service_detail(e: BaseException) -> str:
    """The service's own reason for refusing a token (``AuthenticationErrorDetail``), if it gave one."""
    m = re.search(r"(?im)^\s*authenticationerrordetail:\s*(.+)$", str(getattr(e, "message", None) or e))
    return f": {_one_line(m.group(1), 160)}" if m else ""


def _version(value: str | None) -> int:
    """A blob's ``sidecar_version``; 0 when missing or malformed (written by something else)."""
    try:
        number = int(value or 0)
    except (TypeError, ValueError):
        return 0
    return number if 0 <= number < 2**63 else 0


def _http_date_ns(value: datetime | None) -> int:
    """Nanoseconds since the epoch of a ``Last-Modified``; 0 when absent."""
    return int(value.timestamp() * 1_000_000_000) if value is not None else 0


# ---------------------------------------------------------------------------------------------
# The SDK's own log records
# ---------------------------------------------------------------------------------------------


class _SdkLogBridge(logging.Handler):
    """Sends the ``azure`` loggers' records (WARNING and up) to :mod:`sidecar.log`, one redacted
    line each, instead of Python's last-resort handler (several raw lines on stderr).
    azure-identity's account of a failed token request comes at debug level: the store's own
    error says it once, in the line that matters."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = redact(_one_line(record.getMessage(), 400))
        except Exception:  # a record that cannot be formatted is not worth a crash
            return
        if record.name.startswith("azure.identity"):
            log.debug("azure_sdk", logger=record.name, detail=text)
        elif record.levelno >= logging.WARNING:
            log.warning("azure_sdk", logger=record.name, detail=text)


def _route_sdk_logs() -> None:
    sdk = logging.getLogger("azure")
    if not any(isinstance(h, _SdkLogBridge) for h in sdk.handlers):
        sdk.addHandler(_SdkLogBridge())
    sdk.propagate = False
    if sdk.level == logging.NOTSET or sdk.level < logging.WARNING:
        sdk.setLevel(logging.WARNING)  # the SDK logs every request at INFO


_route_sdk_logs()


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------


class _Conflict(Exception):
    """A conditional write found the blob changed (412) or present (409 BlobAlreadyExists)."""


class AzureBlobStore:
    """A :class:`~sidecar.store.base.Store` on one Azure Blob container (or Azurite)."""

    def __init__(
        self,
        location: BlobLocation,
        credentials: _Credentials,
        *,
        max_concurrency: int = 32,
        retry_total: int = 4,
        retry_backoff: float = 0.5,
        connection_timeout: float = 10,
        read_timeout: float = 60,
        request_hook: Callable[[str, str], None] | None = None,
        proxy_env: Mapping[str, str] | None = None,
        create: bool = True,
    ) -> None:
        self.location = location
        self.create = create
        self.container_name = location.container
        self.prefix = location.prefix
        self._creds = credentials
        self.credential_source = credentials.source
        self._retry_total = retry_total
        endpoint_url = credentials.endpoint or location.endpoint  # a connection string's replaces the URL's
        parts = urlsplit(endpoint_url)
        self.account = credentials.account or location.account
        self.endpoint = redact(endpoint_url, credentials.secrets)
        self.description = redact(
            "/".join(p for p in (endpoint_url, location.container, location.prefix) if p), credentials.secrets
        )
        self._proxy = proxy_for(parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80),
                                os.environ if proxy_env is None else proxy_env)
        self._secrets = credentials.secrets + (self._proxy.secrets if self._proxy is not None else ())
        self._endpoint_url = endpoint_url
        self._client_settings = dict(max_concurrency=max_concurrency, retry_total=retry_total, retry_backoff=retry_backoff,
                                     connection_timeout=connection_timeout, read_timeout=read_timeout, hook=request_hook)
        self._service: BlobServiceClient | None = None
        self._container: ContainerClient | None = None
        self._name_prefix = f"{location.prefix}/" if location.prefix else ""
        # What this store last saw of each blob (from list, get, put or a conflict read): the
        # ETag to make the next put conditional on, and the version stamp (mtime_ns) behind it.
        self._seen: dict[str, ObjectInfo] = {}
        self._opened = False
        self._first_page: tuple[list[Any], str | None] | None = None  # open()'s page and its continuation
        self._closed = False

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "", env: Mapping[str, str] | None = None, **options: Any
    ) -> "AzureBlobStore":
        """A store for ``SIDECAR_STORE=url`` and ``SIDECAR_PREFIX=prefix`` (not yet opened).

        ``env`` (default ``os.environ``) supplies the credentials; ``options`` tune the client
        (``max_concurrency`` connections, ``retry_total``, ``retry_backoff``,
        ``connection_timeout``, ``read_timeout``, ``request_hook(method, path)`` called for every
        request sent, ``create=False`` for a read-only use such as ``status``: a missing container
        lists as empty and is not created). The proxy, if any, comes from ``env`` too (:func:`proxy_for`).
        Raises ValueError, without any secret in the message, for a bad URL, credential or proxy.
        """
        env = os.environ if env is None else env
        conn = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
        known = _connection_string_fields(conn).get("accountname") or env.get("AZURE_STORAGE_ACCOUNT") or None
        try:
            location = parse_store_url(url, prefix, known_account=known)
        except ValueError as e:
            # The URL may carry a SAS token; never echo it.
            raise ValueError(redact(str(e), [urlsplit(url).query] if "?" in url else [])) from None
        options.setdefault("proxy_env", env)
        # Checked before a credential object exists that an error would leave open.
        proxy_for(location.scheme, "", 0, env)
        creds = _pick_credentials(env, location.account, location.sas, location.scheme,
                                  float(options.get("connection_timeout", 10)))
        if creds.source == "DefaultAzureCredential":
            creds.secrets = tuple(s for s in (env.get("IDENTITY_HEADER"), env.get("AZURE_CLIENT_SECRET")) if s)
        return cls(location, creds, **options)

    # -- helpers -------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"AzureBlobStore({self.description!r}, credential={self.credential_source!r})"

    def _container_client(self) -> ContainerClient:
        """The store's one SDK client, made on first use (its aiohttp session needs the event loop).

        One session for every request: a connection pool of ``max_concurrency`` connections,
        the environment not consulted per request (``trust_env=False``: no ``.netrc`` or proxy
        look-up on each; the proxy is chosen once, by :func:`proxy_for`), no cookies, bodies
        not decompressed.
        """
        if self._container is None:
            if self._closed:
                raise StoreError(f"{self._where()}: the store is closed")
            s: dict[str, Any] = self._client_settings
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=s["max_concurrency"]), trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
            )
            options: dict[str, Any] = dict(
                transport=AioHttpTransport(session=session, session_owner=True,
                                           connection_timeout=s["connection_timeout"], read_timeout=s["read_timeout"]),
                retry_policy=_Retry(s["retry_backoff"], s["retry_total"]),
                max_single_put_size=MAX_SINGLE_PUT_SIZE,
                max_block_size=CHUNK_BYTES,
                max_single_get_size=CHUNK_BYTES,
                max_chunk_get_size=CHUNK_BYTES,
            )
            if self._proxy is not None:
                options["proxies"] = {urlsplit(self._endpoint_url).scheme: self._proxy.url}
            hook = s["hook"]
            if hook is not None:
                options["raw_request_hook"] = lambda r: hook(r.http_request.method, urlsplit(r.http_request.url).path)
            self._service = BlobServiceClient(self._endpoint_url, credential=self._creds.credential, **options)
            self._container = self._service.get_container_client(self.container_name)
        return self._container

    def _name(self, key: str) -> str:
        try:
            validate_relpath(key)
        except UnsafeKey as e:
            raise StoreError(f"refusing unsafe key: {e}") from None
        name = self._name_prefix + key
        if len(name.encode("utf-8", "surrogateescape")) > MAX_KEY_BYTES:
            raise StoreError(f"refusing key {key[:60]!r}...: blob name longer than {MAX_KEY_BYTES} bytes")
        return name

    def _info(self, key: str, size: int, metadata: Mapping[str, str] | None, etag: str | None,
              last_modified: datetime | None) -> ObjectInfo:
        md = {k.lower(): v for k, v in (metadata or {}).items()}
        etag = _quoted_etag(etag)
        version = _version(md.get(META_VERSION))
        try:
            sha = md[META_SHA256]
            if _SHA256_RE.match(sha):
                mtime = int(md[META_MTIME])
                return ObjectInfo(key, size, sha, mtime if 0 <= mtime < 2**63 else 0, int(md[META_MODE], 8) & 0o7777,
                                  etag, version)
        except (KeyError, ValueError, TypeError):
            pass
        return ObjectInfo(key, size, None, _http_date_ns(last_modified), FOREIGN_MODE, etag, version)

    def _where(self) -> str:
        return f"Azure Blob store (account {self.account!r}, container {self.container_name!r})"

    def _error(self, e: BaseException, doing: str) -> StoreError:
        """One clear, secret-free line for a failed operation; transient when retrying can help."""
        where = self._where()
        creds = self._creds
        secrets = self._secrets

        def done(cls: type[StoreError], text: str) -> StoreError:
            return cls(redact(_one_line(f"{where}: {doing} failed: {text}", 600), secrets))

        status = getattr(e, "status_code", None) if isinstance(e, HttpResponseError) else None
        if isinstance(e, ClientAuthenticationError) and status is None:
            # The credential itself could not get a token (no identity here, or a bad one).
            return done(
                StoreError,
                f"no usable Azure credential via {creds.source} ({_credential_reason(e)}); set "
                "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, "
                "or give the pod a managed/workload identity (AZURE_CLIENT_ID for a user-assigned one)",
            )
        if status is None:
            if isinstance(e, AzureError):
                return self._connection_error(e, done)
            return done(StoreError, _one_line(f"{type(e).__name__}: {e}", 160))
        code = _code(e)
        detail = f" ({' '.join(str(x) for x in (status, code) if x)})"
        if status == 407 and self._proxy is not None:
            return done(StoreError, f"the proxy {self._proxy.description} refused the request to {self.endpoint} "
                                    "(HTTP 407); check the credentials in HTTP_PROXY, or add the host to NO_PROXY")
        if status in (401, 403):
            if code in ("AuthorizationPermissionMismatch", "AuthorizationResourceTypeMismatch",
                        "AuthorizationServiceMismatch"):
                if creds.source == "DefaultAzureCredential":
                    what = (f"grant the identity the 'Storage Blob Data Contributor' role on container "
                            f"{self.container_name!r} (assignments take minutes to apply)")
                elif creds.source in ("SAS token", "connection string"):
                    what = "a SAS needs read, add, create, write, delete and list permissions on the container"
                else:
                    what = "check the account's firewall and network rules allow this host"
                return done(StoreError, f"permission denied{detail}; {what}")
            if code == "AuthorizationFailure":
                # Azure: a firewall / network rule or SAS scope; Azurite: also a wrong key.
                return done(StoreError, f"request not authorized{detail}; {creds.hint(self.account)}, "
                                        "and that the account's firewall / network rules allow this host")
            if code == "KeyBasedAuthenticationNotPermitted":
                return done(StoreError, f"shared key access is disabled on the account{detail}; use a managed identity or a SAS")
            if code == "AccountIsDisabled":
                return done(StoreError, f"the storage account is disabled{detail}")
            return done(StoreError, f"authentication failed{detail}{_service_detail(e)}; {creds.hint(self.account)}")
        if status == 404 and code == "ContainerNotFound":
            return done(StoreError, f"the container does not exist{detail}; was it deleted? the sidecar creates it on start")
        if status in TRANSIENT_STATUS or (status == 409 and code == "ContainerBeingDeleted"):
            kind = "throttled" if status in (429, 503) else "service error"
            retried = "" if status == 429 else f" after {self._retry_total} retries"
            return done(TransientStoreError, f"{kind}{detail}{retried}; will retry later")
        if code in ("Md5Mismatch", "Crc64Mismatch"):
            return done(TransientStoreError, f"the data was corrupted in transit{detail}; will retry")
        if status == 412:
            return done(TransientStoreError, f"the blob changed while it was read{detail}; will retry")
        return done(StoreError, f"unexpected answer{detail}")

    def _connection_error(self, e: BaseException, done: Callable[[type[StoreError], str], StoreError]) -> StoreError:
        kind, proxy_status = _failure(e)
        proxy = self._proxy
        if proxy is not None and kind in ("proxy", "dns", "refused"):
            # Only the proxy is looked up and dialled when there is one.
            if kind != "proxy":
                return done(StoreError if not self._opened else TransientStoreError,
                            f"{_FAILED[kind]} for the proxy {proxy.description} (reaching {self.endpoint}); check "
                            "HTTPS_PROXY / HTTP_PROXY, or add the host to NO_PROXY")
            if proxy_status in (401, 403, 407):
                return done(StoreError, f"the proxy {proxy.description} refused the connection to {self.endpoint} "
                                        f"(HTTP {proxy_status}); check the credentials in HTTPS_PROXY and the proxy's "
                                        "allow list, or add the host to NO_PROXY")
            return done(TransientStoreError, f"the proxy {proxy.description} could not reach {self.endpoint} (HTTP "
                                             f"{proxy_status}; check the account name in SIDECAR_STORE); will retry later")
        endpoint = self.endpoint + (f" through the proxy {proxy.description}" if proxy is not None else "")
        if kind == "tls":
            return done(StoreError, f"TLS failure talking to {endpoint}; check the URL scheme and host, "
                                    "the CA bundle (SSL_CERT_FILE) and any TLS-intercepting proxy")
        what = _FAILED.get(kind, "connection failed")
        if not self._opened and kind in ("dns", "refused"):
            # Never reached the service at all: a wrong account name, endpoint or port.
            check = ("check the account name in SIDECAR_STORE (or the connection string's endpoint) "
                     "and DNS / private-endpoint resolution") if kind == "dns" else \
                    "check the endpoint host and port are right and the service is running and reachable"
            return done(StoreError, f"{what} for {endpoint}; {check}")
        return done(TransientStoreError, f"{what} for {endpoint} after {self._retry_total} retries; "
                                         "check network reachability (firewall, proxy); will retry later")

    async def _put_blob(self, name: str, data: "bytes | Source", md5: bytes, metadata: dict[str, str],
                        etag: str | None, staged: bool = False) -> str | None:
        """Upload one blob, conditional on ``etag`` (``If-Match``) or on its absence
        (``If-None-Match: *``); returns the new ETag, raises :class:`_Conflict` when the
        condition fails. ``md5`` is recorded as the blob's Content-MD5; the SDK sends the
        transactional Content-MD5 of each request (``validate_content``), which the service checks.
        ``staged``: bytes go up as staged blocks and one conditional Put Block List instead of a
        Put Blob (see :meth:`_commit_blocks`)."""
        blob = self._container_client().get_blob_client(name)
        condition: dict[str, Any] = ({"etag": etag, "match_condition": MatchConditions.IfNotModified} if etag
                                     else {"match_condition": MatchConditions.IfMissing})
        if staged and isinstance(data, bytes):
            return await self._commit_blocks(blob, data, md5, metadata, condition)
        try:
            # a Source is streamed in blocks and committed only after its last chunk checked out
            body, length = (data, len(data)) if isinstance(data, bytes) else (data.chunks(), data.size)
            response = await blob.upload_blob(
                body, length=length, overwrite=True, metadata=metadata, validate_content=True,
                content_settings=ContentSettings(content_type="application/octet-stream", content_md5=bytearray(md5)),
                max_concurrency=4 if isinstance(data, bytes) else 1, **condition,
            )
        except ResourceModifiedError:
            raise _Conflict() from None  # 412: someone else wrote it
        except ResourceExistsError as e:
            if _code(e) != "BlobAlreadyExists":
                raise
            raise _Conflict() from None  # 409: someone else made it
        except HttpResponseError as e:
            if _code(e) != "InvalidBlockList":
                raise
            raise _Conflict() from None  # another writer committed while we staged blocks
        return response.get("etag")

    async def _commit_blocks(self, blob: Any, data: bytes, md5: bytes, metadata: dict[str, str],
                             condition: dict[str, Any]) -> str | None:
        """Write ``data`` as staged blocks and one conditional Put Block List, which replaces
        whatever uncommitted blocks the blob holds. For a blob that holds only the uncommitted
        blocks of a dead upload (a sidecar killed while streaming): Azure counts it as absent,
        but Azurite answers a Put Blob with ``If-None-Match: *`` there with 409
        ``BlobAlreadyExists``, while its Put Block List honours the condition. The new block ids
        take the length of the ones already staged (the service requires one length per blob)."""
        try:
            _, uncommitted = await blob.get_block_list("uncommitted")
            width = len(uncommitted[0].id) if uncommitted else 0
            if not (width and width % 4 == 0 and 8 <= width <= 88):  # base64 of 6..64 bytes
                width = 64  # the SDK's own: base64 of 48 digits
            ids: list[str] = []
            view = memoryview(data)
            for start in range(0, len(data), CHUNK_BYTES):
                ids.append(base64.b64encode(os.urandom(width * 3 // 4)).decode())
                piece = view[start:start + CHUNK_BYTES]
                await blob.stage_block(ids[-1], bytes(piece), length=len(piece), validate_content=True)
            response = await blob.commit_block_list(
                ids, metadata=metadata,
                content_settings=ContentSettings(content_type="application/octet-stream", content_md5=bytearray(md5)),
                **condition,
            )
        except ResourceModifiedError:
            raise _Conflict() from None
        except ResourceExistsError as e:
            if _code(e) != "BlobAlreadyExists":
                raise
            raise _Conflict() from None  # committed by another writer meanwhile
        except HttpResponseError as e:
            if _code(e) not in ("InvalidBlockList", "InvalidBlobOrBlock"):
                raise
            raise _Conflict() from None  # another writer's blocks replaced ours meanwhile
        return response.get("etag")

    async def _page(self, start: str, token: str | None, size: int) -> tuple[list[Any], str | None]:
        """One page of the listing (blob properties with metadata) and the token of the next."""
        pages = self._container_client().list_blobs(
            name_starts_with=start or None, include=["metadata"], results_per_page=size,
        ).by_page(continuation_token=token)
        page = await pages.__anext__()
        return [props async for props in page], pages.continuation_token or None  # type: ignore[attr-defined]

    def _listed(self, props: Any, start: str, cut: int) -> ObjectInfo | None:
        name = props.name
        if not name.startswith(start) or name.endswith("/"):
            return None  # directory placeholders (hierarchical namespace accounts)
        md = props.metadata or {}
        if str(md.get("hdi_isfolder", "")).lower() == "true":
            return None
        info = self._info(name[cut:], props.size, md, props.etag, props.last_modified)
        self._seen[name] = info
        return info

    # -- interface -----------------------------------------------------------------------------
    async def open(self) -> None:
        """Check the credentials and the container with one list request, the first page of the
        listing a start-up makes next (kept for that :meth:`list`, so it costs no extra round
        trip); create the container when missing (unless ``create`` is off: then it lists as empty)."""
        try:
            try:
                self._first_page = await self._page(self._name_prefix, None, FIRST_PAGE_RESULTS)
            except ResourceNotFoundError as e:
                if _code(e) != "ContainerNotFound":
                    raise
                if not self.create:
                    self._first_page = ([], None)
                    self._opened = True
                    return
                try:
                    await self._container_client().create_container()
                    log.info("container_created", store=self.description)
                except ResourceExistsError as e2:
                    if _code(e2) != "ContainerAlreadyExists":
                        raise
        except AzureError as e:
            raise self._error(e, "opening the store") from None
        self._opened = True

    async def put(self, key: str, data: bytes | Source, meta: ObjectMeta, if_version: int | None = None) -> ObjectInfo:
        """Upload ``data`` unless the store already holds a newer version of ``key`` (or, with
        ``if_version``, unless it holds any other version than that: a compare-and-swap on the
        ETag seen with it).

        Conditional-write rule, with ``sidecar_version`` as the version: the write is
        conditional on the ETag this store last saw for the blob (``If-Match``), or on the blob's
        absence (``If-None-Match: *``) when it has seen none, so the steady state costs exactly one
        request. When the condition fails (412/409), the blob's properties are read once: if the
        stored version is higher than ``meta.version`` nothing is written and the stored object's
        :class:`ObjectInfo` is returned (the caller sees ``info.version > meta.version``);
        otherwise the write is retried against the fresh ETag. Versions of a blob therefore never
        go backwards, whichever writer (or store object) finishes first. A blob without a
        version (an older release's, another tool's) has version 0.
        """
        name = self._name(key)
        self._first_page = None  # a listing from before this write must not be served after it
        metadata = {META_SHA256: meta.sha256, META_MTIME: str(meta.mtime_ns), META_MODE: format(meta.mode & 0o7777, "o"),
                    META_VERSION: str(meta.version)}
        seen = self._seen.get(name)
        if seen is not None and (supersedes(seen, meta.version) or (if_version is not None and seen.version != if_version)):
            return seen  # known newer (or other) already: superseded without a request
        if if_version and seen is None:  # a swap against an object this store has not seen: look first
            try:
                props = await self._container_client().get_blob_client(name).get_blob_properties()
            except ResourceNotFoundError:
                return ObjectInfo(key, 0, None, 0, 0)  # not there: the swap is refused
            except AzureError as e:
                raise self._error(e, f"uploading {key!r}") from None
            seen = self._seen[name] = self._info(key, props.size, props.metadata, props.etag, props.last_modified)
            if seen.version != if_version:
                return seen
        etag = seen.etag if seen is not None else None
        md5 = hashlib.md5(data).digest() if isinstance(data, bytes) else data.md5
        staged = False  # bytes go up as blocks: a dead upload's uncommitted blocks are in the way
        try:
            for _ in range(MAX_CONFLICT_ROUNDS):
                try:
                    new_etag = await self._put_blob(name, data, md5, metadata, etag, staged)
                except _Conflict:
                    pass
                else:
                    info = ObjectInfo(key, meta.size, meta.sha256, meta.mtime_ns, meta.mode & 0o7777, _quoted_etag(new_etag),
                                      meta.version)
                    self._seen[name] = info
                    return info
                # Conflict: read what is there now, once, and decide.
                try:
                    props = await self._container_client().get_blob_client(name).get_blob_properties()
                except ResourceNotFoundError as e:
                    if _code(e) == "ContainerNotFound":
                        raise
                    self._seen.pop(name, None)
                    if if_version not in (None, 0):
                        return ObjectInfo(key, 0, None, 0, 0)  # gone since it was read: nothing written
                    # "exists" to If-None-Match, yet no blob: only uncommitted blocks are there
                    staged = staged or etag is None
                    etag = None  # deleted meanwhile: write it if still absent
                    continue
                current = self._info(key, props.size, props.metadata, props.etag, props.last_modified)
                self._seen[name] = current
                if if_version is not None and current.version != if_version:
                    return current  # changed since it was read: the swap is refused
                if supersedes(current, meta.version):
                    log.debug("upload_superseded", key=key, detail="a newer version is in the store")
                    return current
                etag = current.etag
        except AzureError as e:
            raise self._error(e, f"uploading {key!r}") from None
        raise TransientStoreError(redact(
            f"{self._where()}: uploading {key!r} failed: the blob kept changing under concurrent "
            "writers; will retry later", self._secrets))

    async def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        name, downloader = await self._download(key)
        try:
            data = await downloader.readall()
        except AzureError as e:
            raise self._download_failed(e, key, name) from None
        props = downloader.properties
        if props.size is not None and props.size != len(data):
            raise self._cut_short(key)
        info = self._info(key, len(data), props.metadata, props.etag, props.last_modified)
        self._seen[name] = info
        return data, info

    async def get_stream(self, key: str) -> tuple[ObjectInfo, AsyncIterator[bytes]]:
        name, downloader = await self._download(key)
        props = downloader.properties
        info = self._info(key, props.size, props.metadata, props.etag, props.last_modified)
        self._seen[name] = info

        async def chunks() -> AsyncIterator[bytes]:
            got = 0
            try:
                async for chunk in downloader.chunks():
                    got += len(chunk)
                    yield chunk
            except AzureError as e:
                raise self._download_failed(e, key, name) from None
            if got != props.size:
                raise self._cut_short(key)

        return info, chunks()

    async def _download(self, key: str):
        """Start downloading ``key``: (blob name, the SDK's downloader, holding the properties)."""
        name = self._name(key)
        try:
            return name, await self._container_client().download_blob(name, max_concurrency=1)
        except AzureError as e:
            raise self._download_failed(e, key, name) from None

    def _download_failed(self, e: AzureError, key: str, name: str) -> StoreError:
        """A missing blob is NotFound (and forgotten); a missing container, or anything else, is
        the store failing, except to a read-only store."""
        if isinstance(e, ResourceNotFoundError) and (_code(e) != "ContainerNotFound" or not self.create):
            self._seen.pop(name, None)
            return NotFound(key)  # (read-only, a container not made yet holds nothing)
        return self._error(e, f"downloading {key!r}")

    def _cut_short(self, key: str) -> TransientStoreError:
        return TransientStoreError(redact(f"{self._where()}: downloading {key!r} failed: the answer was cut "
                                          "short; will retry", self._secrets))

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        start = self._name_prefix + prefix
        cut = len(self._name_prefix)
        token: str | None = None
        try:
            if not prefix and self._first_page is not None:
                items, token = self._first_page  # fetched by open() just before
                self._first_page = None
                for props in items:
                    if (info := self._listed(props, start, cut)) is not None:
                        yield info
                if token is None:
                    return
            pages = self._container_client().list_blobs(
                name_starts_with=start or None, include=["metadata"], results_per_page=PAGE_RESULTS,
            ).by_page(continuation_token=token)
            async for page in pages:
                async for props in page:
                    if (info := self._listed(props, start, cut)) is not None:
                        yield info
        except ResourceNotFoundError as e:
            if self.create or _code(e) != "ContainerNotFound":
                raise self._error(e, f"listing {prefix!r}") from None
            return  # read-only: a container not made yet holds nothing
        except AzureError as e:
            raise self._error(e, f"listing {prefix!r}") from None

    async def delete(self, key: str) -> None:
        name = self._name(key)
        self._first_page = None
        try:
            await self._container_client().delete_blob(name, delete_snapshots="include")
        except ResourceNotFoundError as e:
            if _code(e) == "ContainerNotFound":
                raise self._error(e, f"deleting {key!r}") from None
        except AzureError as e:
            raise self._error(e, f"deleting {key!r}") from None
        self._seen.pop(name, None)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._service is not None:
                await self._service.close()
        finally:
            if self._creds.owned is not None:
                await self._creds.owned.close()

    async def __aenter__(self) -> "AzureBlobStore":
        await self.open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
