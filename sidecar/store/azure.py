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
query), else ``DefaultAzureCredential`` (``AZURE_CLIENT_ID`` picks a user-assigned identity).

Each object is one block blob whose metadata carries ``sidecar_sha256``, ``sidecar_mtime_ns``
and ``sidecar_mode``. ``sidecar_mtime_ns`` is also the version stamp of the conditional-write rule
that keeps a stale upload from replacing a newer one (see :meth:`AzureBlobStore.put`).
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, Mapping
from urllib.parse import quote, unquote, urlsplit
from xml.etree import ElementTree

from sidecar.paths import MAX_KEY_BYTES, UnsafeKey, validate_relpath
from sidecar.store import blobapi
from sidecar.store.base import NotFound, ObjectInfo, ObjectMeta, StoreError, TransientStoreError
from sidecar.store.proxy import Proxy, check as check_proxy_env, proxy_for

log = logging.getLogger(__name__)

# Metadata names must be valid C# identifiers; Azure treats them case-insensitively.
META_SHA256 = "sidecar_sha256"
META_MTIME = "sidecar_mtime_ns"
META_MODE = "sidecar_mode"

#: Mode reported for blobs that carry no sidecar metadata (written by something else).
FOREIGN_MODE = 0o600

#: How often put re-reads and retries when concurrent writers keep changing the blob.
MAX_CONFLICT_ROUNDS = 8
#: What a connection failure of each kind is called in a message.
_FAILED = {"dns": "cannot resolve the host", "refused": "connection refused", "timeout": "timed out"}
#: Blobs in the listing's first page (``open()`` fetches it). Small, so that a restore starts
#: downloading early while the next, full-size (5,000) pages are fetched: a page of 1,000 blobs
#: with metadata took the emulator 60-80 ms, one of 250 about 15 ms.
FIRST_PAGE_RESULTS = 250

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
        segments.extend(s for s in part.strip("/").split("/") if s)
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
    auth: Any  # a blobapi authorisation: SharedKey, SasToken or BearerToken
    endpoint: str | None = None  # scheme://host[:port][/account] from a connection string
    account: str | None = None

    def hint(self, account: str) -> str:
        return {
            "connection string": "check AZURE_STORAGE_CONNECTION_STRING (AccountName/AccountKey or SAS) is current for this account",
            "account key": f"check AZURE_STORAGE_KEY is a current access key of account {account!r}",
            "SAS token": "check the SAS token is for this account and container, has not expired (se=) and the clock is right",
            "DefaultAzureCredential": "check the pod's managed or workload identity (AZURE_CLIENT_ID for a user-assigned one) and its token",
        }[self.source]


def _from_connection_string(conn: str) -> _Credentials:
    f = _connection_string_fields(conn)
    secrets = tuple(s for s in (conn, f.get("accountkey"), f.get("sharedaccesssignature")) if s)
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
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{bad}: BlobEndpoint must be an http(s) URL")
    if not account:
        m = _HOST_STYLE_RE.match(parts.hostname)
        account = m.group("account") if m else (parts.path.strip("/").split("/")[0] or None)
    if not account:
        raise ValueError(f"{bad}: it has no AccountName")
    if f.get("accountkey"):
        auth: Any = blobapi.SharedKey(account, f["accountkey"])
    elif f.get("sharedaccesssignature"):
        auth = blobapi.SasToken(f["sharedaccesssignature"])
    else:
        raise ValueError(f"{bad}: it has neither AccountKey nor SharedAccessSignature")
    return _Credentials("connection string", secrets, auth, endpoint=endpoint, account=account)


def _pick_credentials(env: Mapping[str, str], account: str, url_sas: str | None, scheme: str) -> _Credentials:
    conn = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    if conn:
        try:
            return _from_connection_string(conn)
        except ValueError as e:
            raise ValueError(redact(str(e), [conn])) from None
    key = env.get("AZURE_STORAGE_KEY", "").strip()
    if key:
        try:
            return _Credentials("account key", (key,), blobapi.SharedKey(account, key))
        except ValueError:
            raise ValueError("AZURE_STORAGE_KEY is not an account key (base64)") from None
    sas = env.get("AZURE_STORAGE_SAS_TOKEN", "").strip().lstrip("?") or (url_sas or "").lstrip("?")
    if sas:
        if "sig=" not in sas:
            raise ValueError("AZURE_STORAGE_SAS_TOKEN does not look like a SAS token (it has no sig=)")
        secrets = tuple(s for s in (sas, *re.findall(r"sig=([^&]+)", sas)) if s)
        return _Credentials("SAS token", secrets, blobapi.SasToken(sas))
    if scheme != "https":
        raise ValueError("an Azure AD token (DefaultAzureCredential) is only sent over https; use an "
                         "https store URL, or AZURE_STORAGE_CONNECTION_STRING / AZURE_STORAGE_KEY for an emulator")
    # Only this path imports azure-identity (and, with it, azure-core and aiohttp).
    from azure.identity.aio import DefaultAzureCredential

    client_id = env.get("AZURE_CLIENT_ID") or None
    cred = DefaultAzureCredential(**({"managed_identity_client_id": client_id} if client_id else {}))
    return _Credentials("DefaultAzureCredential", (), blobapi.BearerToken(cred))


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------


class _Conflict(Exception):
    """A conditional write found the blob changed (412) or present (409 BlobAlreadyExists)."""


def _http_date_ns(value: str | None) -> int:
    """Nanoseconds since the epoch of an HTTP date (``Last-Modified``); 0 when absent or unreadable.
    Only blobs without the sidecar's metadata need it, so ``email.utils`` is imported on demand."""
    if not value:
        return 0
    from email.utils import parsedate_to_datetime

    try:
        return int(parsedate_to_datetime(value).timestamp() * 1_000_000_000)
    except (TypeError, ValueError):
        return 0


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
    ) -> None:
        self.location = location
        self.container_name = location.container
        self.prefix = location.prefix
        self._creds = credentials
        self.credential_source = credentials.source
        self._retry_total = retry_total
        if credentials.endpoint:  # a connection string's endpoint replaces the URL's
            endpoint_url = credentials.endpoint
        else:
            endpoint_url = location.endpoint
        parts = urlsplit(endpoint_url)
        self.account = credentials.account or location.account
        self.endpoint = redact(endpoint_url, credentials.secrets)
        self.description = redact(
            "/".join(p for p in (endpoint_url, location.container, location.prefix) if p), credentials.secrets
        )
        proxy = proxy_for(parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80),
                          os.environ if proxy_env is None else proxy_env)
        self._api = blobapi.BlobApi(
            f"{parts.scheme}://{parts.netloc}", parts.path, credentials.auth, max_connections=max_concurrency,
            retry_total=retry_total, retry_backoff=retry_backoff, connection_timeout=connection_timeout,
            read_timeout=read_timeout, hook=request_hook, proxy=proxy,
        )
        self._container_path = self._api.path(location.container)
        self._name_prefix = f"{location.prefix}/" if location.prefix else ""
        # What this store last saw of each blob (from list, get, put or a conflict read): the
        # ETag to make the next put conditional on, and the version stamp (mtime_ns) behind it.
        self._seen: dict[str, ObjectInfo] = {}
        self._opened = False
        self._first_page: bytes | None = None  # open()'s listing page, for the first list()
        self._closed = False

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "", env: Mapping[str, str] | None = None, **options: Any
    ) -> "AzureBlobStore":
        """A store for ``SIDECAR_STORE=url`` and ``SIDECAR_PREFIX=prefix`` (not yet opened).

        ``env`` (default ``os.environ``) supplies the credentials; ``options`` tune the client
        (``max_concurrency`` connections, ``retry_total``, ``retry_backoff``,
        ``connection_timeout``, ``read_timeout``, ``request_hook``). The proxy, if any, comes
        from ``env`` too (``HTTPS_PROXY``, ``NO_PROXY``: :mod:`sidecar.store.proxy`).
        Raises ValueError, without any secret in the message, for a bad URL or credential.
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
        check_proxy_env(location.scheme, env)  # before a credential object exists that an error would leave open
        return cls(location, _pick_credentials(env, location.account, location.sas, location.scheme), **options)

    # -- helpers -------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"AzureBlobStore({self.description!r}, credential={self.credential_source!r})"

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
              last_modified: str | None) -> ObjectInfo:
        md = {k.lower(): v for k, v in (metadata or {}).items()}
        etag = _quoted_etag(etag)
        try:
            sha = md[META_SHA256]
            if _SHA256_RE.match(sha):
                return ObjectInfo(key, size, sha, int(md[META_MTIME]), int(md[META_MODE], 8) & 0o7777, etag)
        except (KeyError, ValueError, TypeError):
            pass
        return ObjectInfo(key, size, None, _http_date_ns(last_modified), FOREIGN_MODE, etag)

    def _where(self) -> str:
        return f"Azure Blob store (account {self.account!r}, container {self.container_name!r})"

    def _error(self, e: BaseException, doing: str) -> StoreError:
        """One clear, secret-free line for a failed request; transient when retrying can help."""
        where = self._where()
        creds = self._creds

        def done(cls: type[StoreError], text: str) -> StoreError:
            return cls(redact(_one_line(f"{where}: {doing} failed: {text}", 600), creds.secrets))

        if isinstance(e, blobapi.CredentialFailure):
            return done(
                StoreError,
                f"no usable Azure credential via {creds.source} ({_one_line(e, 160)}); set "
                "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, "
                "or give the pod a managed/workload identity (AZURE_CLIENT_ID for a user-assigned one)",
            )
        if isinstance(e, blobapi.ConnectionFailure):
            return self._connection_error(e, done)
        if not isinstance(e, blobapi.HttpError):
            return done(StoreError, _one_line(f"{type(e).__name__}: {e}", 160))
        status, code = e.status, e.code
        detail = f" ({' '.join(str(x) for x in (status, code) if x)})"
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
            return done(StoreError, f"authentication failed{detail}; {creds.hint(self.account)}")
        if status == 404 and code == "ContainerNotFound":
            return done(StoreError, f"the container does not exist{detail}; was it deleted? the sidecar creates it on start")
        if status in blobapi.TRANSIENT_STATUS or (status == 409 and code == "ContainerBeingDeleted"):
            kind = "throttled" if status in (429, 503) else "service error"
            return done(TransientStoreError, f"{kind}{detail} after {self._retry_total} retries; will retry later")
        if code in ("Md5Mismatch", "Crc64Mismatch"):
            return done(TransientStoreError, f"the data was corrupted in transit{detail}; will retry")
        if status == 412:
            return done(TransientStoreError, f"the blob changed while it was read{detail}; will retry")
        return done(StoreError, f"unexpected answer{detail}")

    def _connection_error(self, e: blobapi.ConnectionFailure, done) -> StoreError:
        proxy = self._api.proxy
        if proxy is not None and e.kind in ("proxy", "dns", "refused"):
            return self._proxy_error(e, proxy, done)
        endpoint = self.endpoint + (f" through the proxy {proxy.description}" if proxy is not None else "")
        if e.kind == "tls":
            return done(StoreError, f"TLS failure talking to {endpoint}; check the URL scheme and host, "
                                    "the CA bundle (SSL_CERT_FILE) and any TLS-intercepting proxy")
        what = _FAILED.get(e.kind, "connection failed")
        if not self._opened and e.kind in ("dns", "refused"):
            # Never reached the service at all: a wrong account name, endpoint or port.
            check = ("check the account name in SIDECAR_STORE (or the connection string's endpoint) "
                     "and DNS / private-endpoint resolution") if e.kind == "dns" else \
                    "check the endpoint host and port are right and the service is running and reachable"
            return done(StoreError, f"{what} for {endpoint}; {check}")
        return done(TransientStoreError, f"{what} for {endpoint} after {self._retry_total} retries; "
                                         "check network reachability (firewall, proxy); will retry later")

    def _proxy_error(self, e: blobapi.ConnectionFailure, proxy: Proxy, done) -> StoreError:
        """The proxy failed, not the account: it could not be reached (only the proxy is looked up
        and dialled), or it refused the tunnel or could not reach the account itself."""
        if e.kind != "proxy":
            return done(StoreError if not self._opened else TransientStoreError,
                        f"{_FAILED[e.kind]} for the proxy {proxy.description} (reaching {self.endpoint}); check "
                        "HTTPS_PROXY / HTTP_PROXY, or add the host to NO_PROXY")
        if e.status in (401, 403, 407):
            return done(StoreError, f"the proxy {proxy.description} refused the connection to {self.endpoint} "
                                    f"(HTTP {e.status}); check the credentials in HTTPS_PROXY and the proxy's allow "
                                    "list, or add the host to NO_PROXY")
        return done(TransientStoreError, f"the proxy {proxy.description} could not reach {self.endpoint} (HTTP "
                                         f"{e.status}; check the account name in SIDECAR_STORE); will retry later")

    def _blob_path(self, name: str) -> str:
        return f"{self._container_path}/{quote(name, safe='~/')}"

    async def _put_blob(self, name: str, data: bytes, md5: bytes, metadata: dict[str, str],
                        etag: str | None) -> str | None:
        """One Put Blob request, conditional on ``etag`` (or on absence); returns the new ETag."""
        headers = {
            "x-ms-blob-type": "BlockBlob",
            "Content-Type": "application/octet-stream",
            "Content-MD5": base64.b64encode(md5).decode(),
        }
        for k, v in metadata.items():
            headers["x-ms-meta-" + k] = v
        if etag:
            headers["If-Match"] = etag
        else:
            headers["If-None-Match"] = "*"
        try:
            response = await self._api.request("PUT", self._blob_path(name), headers=headers, body=data, expect=(201,))
        except blobapi.HttpError as e:
            if e.status == 412 or (e.status == 409 and e.code == "BlobAlreadyExists"):
                raise _Conflict() from None
            raise
        return response.headers.get("etag")

    async def _list_page(self, start: str, marker: str, size: int = 5000) -> bytes:
        query = [("restype", "container"), ("comp", "list"), ("include", "metadata"), ("maxresults", str(size))]
        if start:
            query.append(("prefix", start))
        if marker:
            query.append(("marker", marker))
        return (await self._api.request("GET", self._container_path, query)).body

    # -- interface -----------------------------------------------------------------------------
    async def open(self) -> None:
        """Check the credentials and the container with one list request, the first page of the
        listing a start-up makes next (kept for that :meth:`list`, so it costs no extra round
        trip); create the container when missing."""
        try:
            try:
                self._first_page = await self._list_page(self._name_prefix, "", FIRST_PAGE_RESULTS)
            except blobapi.HttpError as e:
                if (e.status, e.code) != (404, "ContainerNotFound"):
                    raise
                await self._api.request("PUT", self._container_path, [("restype", "container")], expect=(201, 409))
                log.info("created container %s", self.container_name)
        except (blobapi.HttpError, blobapi.ConnectionFailure, blobapi.CredentialFailure) as e:
            raise self._error(e, "opening the store") from None
        self._opened = True

    async def put(self, key: str, data: bytes, meta: ObjectMeta) -> ObjectInfo:
        """Upload ``data`` unless the store already holds a newer version of ``key``.

        Conditional-write rule, with ``sidecar_mtime_ns`` as the version stamp: the write is
        conditional on the ETag this store last saw for the blob (``If-Match``), or on the blob's
        absence (``If-None-Match: *``) when it has seen none, so the steady state costs exactly one
        request. When the condition fails (412/409), the blob's properties are read once: if the
        stored stamp is newer than ``meta.mtime_ns`` nothing is written and the stored object's
        :class:`ObjectInfo` is returned (the caller sees ``info.mtime_ns != meta.mtime_ns``);
        otherwise the write is retried against the fresh ETag. Stamps on a blob therefore never
        go backwards, whichever writer (or store object) finishes first.
        """
        name = self._name(key)
        self._first_page = None  # a listing from before this write must not be served after it
        metadata = {META_SHA256: meta.sha256, META_MTIME: str(meta.mtime_ns), META_MODE: format(meta.mode & 0o7777, "o")}
        seen = self._seen.get(name)
        if seen is not None and seen.sha256 is not None and seen.mtime_ns > meta.mtime_ns:
            return seen  # known newer already: a stale upload, superseded without a request
        etag = seen.etag if seen is not None else None
        md5 = hashlib.md5(data).digest()  # once; the service checks it and keeps it as Content-MD5
        try:
            for _ in range(MAX_CONFLICT_ROUNDS):
                try:
                    new_etag = await self._put_blob(name, data, md5, metadata, etag)
                except _Conflict:
                    pass  # 412 / 409 BlobAlreadyExists: someone else wrote it
                else:
                    info = ObjectInfo(key, meta.size, meta.sha256, meta.mtime_ns, meta.mode & 0o7777, _quoted_etag(new_etag))
                    self._seen[name] = info
                    return info
                # Conflict: read what is there now, once, and decide.
                try:
                    props = await self._api.request("HEAD", self._blob_path(name))
                except blobapi.HttpError as e:
                    if e.status != 404 or e.code == "ContainerNotFound":
                        raise
                    self._seen.pop(name, None)
                    etag = None  # deleted meanwhile: write it if still absent
                    continue
                h = props.headers
                current = self._info(key, int(h.get("content-length") or 0), props.metadata(), h.get("etag"),
                                     h.get("last-modified"))
                self._seen[name] = current
                if current.sha256 is not None and current.mtime_ns > meta.mtime_ns:
                    log.debug("upload of %r superseded by a newer version in the store", key)
                    return current
                etag = current.etag
        except (blobapi.HttpError, blobapi.ConnectionFailure, blobapi.CredentialFailure) as e:
            raise self._error(e, f"uploading {key!r}") from None
        raise TransientStoreError(redact(
            f"{self._where()}: uploading {key!r} failed: the blob kept changing under concurrent "
            "writers; will retry later", self._creds.secrets))

    async def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        name = self._name(key)
        try:
            response = await self._api.request("GET", self._blob_path(name))
        except blobapi.HttpError as e:
            if e.status == 404 and e.code != "ContainerNotFound":
                self._seen.pop(name, None)
                raise NotFound(key) from None
            raise self._error(e, f"downloading {key!r}") from None
        except (blobapi.ConnectionFailure, blobapi.CredentialFailure) as e:
            raise self._error(e, f"downloading {key!r}") from None
        data = response.body
        h = response.headers
        length = h.get("content-length")
        if length is not None and length.isdigit() and int(length) != len(data):
            raise TransientStoreError(redact(f"{self._where()}: downloading {key!r} failed: the answer was cut "
                                             "short; will retry", self._creds.secrets))
        info = self._info(key, len(data), response.metadata(), h.get("etag"), h.get("last-modified"))
        self._seen[name] = info
        return data, info

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        start = self._name_prefix + prefix
        cut = len(self._name_prefix)
        marker = ""
        while True:
            try:
                if not marker and not prefix and self._first_page is not None:
                    body, self._first_page = self._first_page, None  # fetched by open() just before
                else:
                    body = await self._list_page(start, marker)
            except (blobapi.HttpError, blobapi.ConnectionFailure, blobapi.CredentialFailure) as e:
                raise self._error(e, f"listing {prefix!r}") from None
            try:
                root = ElementTree.fromstring(body)
            except ElementTree.ParseError:
                raise TransientStoreError(f"{self._where()}: listing {prefix!r} failed: the answer was not "
                                          "a blob list; will retry") from None
            for blob in root.iterfind("Blobs/Blob"):
                name_el = blob.find("Name")
                name = (name_el.text if name_el is not None else None) or ""
                if name_el is not None and name_el.get("Encoded", "").lower() == "true":
                    name = unquote(name)
                if not name.startswith(start) or name.endswith("/"):
                    continue  # directory placeholders (hierarchical namespace accounts)
                props = blob.find("Properties")
                md_el = blob.find("Metadata")
                md = {child.tag: child.text or "" for child in md_el} if md_el is not None else {}
                if str(md.get("hdi_isfolder", "")).lower() == "true":
                    continue
                size = int(props.findtext("Content-Length") or 0) if props is not None else 0
                etag = props.findtext("Etag") if props is not None else None
                modified = props.findtext("Last-Modified") if props is not None else None
                info = self._info(name[cut:], size, md, etag, modified)
                self._seen[name] = info
                yield info
            marker = root.findtext("NextMarker") or ""
            if not marker:
                return

    async def delete(self, key: str) -> None:
        name = self._name(key)
        self._first_page = None
        try:
            await self._api.request("DELETE", self._blob_path(name), headers={"x-ms-delete-snapshots": "include"},
                                    expect=(202,))
        except blobapi.HttpError as e:
            if e.status != 404 or e.code == "ContainerNotFound":
                raise self._error(e, f"deleting {key!r}") from None
        except (blobapi.ConnectionFailure, blobapi.CredentialFailure) as e:
            raise self._error(e, f"deleting {key!r}") from None
        self._seen.pop(name, None)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._api.aclose()

    async def __aenter__(self) -> "AzureBlobStore":
        await self.open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
