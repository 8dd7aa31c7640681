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
import random
import re
import socket
import ssl
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from xml.etree import ElementTree
from typing import Any, AsyncIterator, Iterable, Mapping
from urllib.parse import quote, unquote, urlsplit

from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.core.rest import HttpRequest
from azure.storage.blob import ContentSettings
from azure.storage.blob.aio import BlobServiceClient, ExponentialRetry

from sidecar.paths import MAX_KEY_BYTES, UnsafeKey, validate_relpath
from sidecar.store.base import NotFound, ObjectInfo, ObjectMeta, StoreError, TransientStoreError

log = logging.getLogger(__name__)

# Metadata names must be valid C# identifiers; Azure treats them case-insensitively.
META_SHA256 = "sidecar_sha256"
META_MTIME = "sidecar_mtime_ns"
META_MODE = "sidecar_mode"

#: Mode reported for blobs that carry no sidecar metadata (written by something else).
FOREIGN_MODE = 0o600

#: How often put re-reads and retries when concurrent writers keep changing the blob.
MAX_CONFLICT_ROUNDS = 8

_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
_CONTAINER_RE = re.compile(r"^(?=.{3,63}$)[a-z0-9](?:-?[a-z0-9])*$")
_HOST_STYLE_RE = re.compile(r"^(?P<account>[a-z0-9]{3,24})\.(?:privatelink\.)?blob\.", re.IGNORECASE)
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})

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


@dataclass
class _Credentials:
    source: str  # "connection string" | "account key" | "SAS token" | "DefaultAzureCredential"
    secrets: tuple[str, ...]
    credential: Any = None  # for account_url clients; None with a connection string
    connection_string: str | None = None
    owned: Any = None  # a credential object we created and must close
    client_id: str | None = None  # user-assigned managed identity, for DefaultAzureCredential

    def hint(self, account: str) -> str:
        return {
            "connection string": "check AZURE_STORAGE_CONNECTION_STRING (AccountName/AccountKey or SAS) is current for this account",
            "account key": f"check AZURE_STORAGE_KEY is a current access key of account {account!r}",
            "SAS token": "check the SAS token is for this account and container, has not expired (se=) and the clock is right",
            "DefaultAzureCredential": "check the pod's managed or workload identity (AZURE_CLIENT_ID for a user-assigned one) and its token",
        }[self.source]


def _pick_credentials(env: Mapping[str, str], account: str, url_sas: str | None) -> _Credentials:
    conn = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    if conn:
        f = _connection_string_fields(conn)
        secrets = tuple(s for s in (conn, f.get("accountkey"), f.get("sharedaccesssignature")) if s)
        return _Credentials("connection string", secrets, connection_string=conn)
    key = env.get("AZURE_STORAGE_KEY", "").strip()
    if key:
        return _Credentials("account key", (key,), credential=AzureNamedKeyCredential(account, key))
    sas = env.get("AZURE_STORAGE_SAS_TOKEN", "").strip().lstrip("?") or (url_sas or "").lstrip("?")
    if sas:
        if "sig=" not in sas:
            raise ValueError("AZURE_STORAGE_SAS_TOKEN does not look like a SAS token (it has no sig=)")
        secrets = tuple(s for s in (sas, *re.findall(r"sig=([^&]+)", sas)) if s)
        return _Credentials("SAS token", secrets, credential=AzureSasCredential(sas))
    from azure.identity.aio import DefaultAzureCredential

    client_id = env.get("AZURE_CLIENT_ID") or None
    cred = DefaultAzureCredential(**({"managed_identity_client_id": client_id} if client_id else {}))
    return _Credentials("DefaultAzureCredential", (), credential=cred, owned=cred, client_id=client_id)


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------


def _code(e: BaseException) -> str | None:
    """The storage error code (``BlobNotFound``...) of an SDK exception, as a plain string."""
    code = getattr(e, "error_code", None)
    code = getattr(code, "value", code)
    return str(code) if code else None


def _cause_chain(e: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo.extend([getattr(x, "inner_exception", None), x.__cause__, x.__context__])


class _Conflict(Exception):
    """A conditional write found the blob changed (412) or present (409 BlobAlreadyExists)."""


class _JitteredExponentialRetry(ExponentialRetry):
    """The SDK's storage retry policy (what it retries: connection errors, timeouts, 408, 429, 5xx)
    with a plain exponential schedule: ``base * 2**(n-1)`` seconds, jittered by +-50 %, capped at
    30 s. With the defaults (0.5 s, 4 retries) a request gives up after about 7.5 s.
    """

    def __init__(self, base: float, retry_total: int) -> None:
        super().__init__(initial_backoff=0, increment_base=2, retry_total=retry_total, random_jitter_range=0)
        self.base = base

    def get_backoff_time(self, settings: dict[str, Any]) -> float:
        backoff = min(self.base * 2 ** max(settings["count"] - 1, 0), 30.0)
        return random.uniform(backoff * 0.5, backoff * 1.5)


class _LazyBlobClient:
    """A BlobClient made only when the slow paths (block upload, conflict read) need one."""

    def __init__(self, container: Any, name: str) -> None:
        self._container, self._name, self._client = container, name, None

    def __getattr__(self, attr: str) -> Any:
        if self._client is None:
            self._client = self._container.get_blob_client(self._name)
        return getattr(self._client, attr)


class AzureBlobStore:
    """A :class:`~sidecar.store.base.Store` on one Azure Blob container (or Azurite)."""

    def __init__(
        self,
        location: BlobLocation,
        credentials: _Credentials,
        *,
        max_single_put_size: int = 8 * 1024 * 1024,
        max_block_size: int = 4 * 1024 * 1024,
        max_concurrency: int = 4,
        retry_total: int = 4,
        retry_backoff: float = 0.5,
        connection_timeout: float = 10,
        read_timeout: float = 60,
        **client_options: Any,
    ) -> None:
        self.location = location
        self.container_name = location.container
        self.prefix = location.prefix
        self._creds = credentials
        self.credential_source = credentials.source
        self._max_single_put_size = max_single_put_size
        self._max_concurrency = max_concurrency
        self._retry_total = retry_total
        options: dict[str, Any] = dict(
            retry_policy=_JitteredExponentialRetry(retry_backoff, retry_total=retry_total),
            max_single_put_size=max_single_put_size,
            max_block_size=max_block_size,
            connection_timeout=connection_timeout,
            read_timeout=read_timeout,
        )
        options.update(client_options)  # e.g. raw_request_hook, transport (tests, tuning)
        try:
            if credentials.connection_string is not None:
                self._service = BlobServiceClient.from_connection_string(credentials.connection_string, **options)
            else:
                self._service = BlobServiceClient(location.endpoint, credential=credentials.credential, **options)
        except ValueError as e:
            raise ValueError(
                f"cannot use the Azure storage {credentials.source}: "
                f"{redact(_one_line(e), credentials.secrets)}"
            ) from None
        fields = _connection_string_fields(credentials.connection_string or "")
        self.account = fields.get("accountname") or self._service.account_name or location.account
        endpoint = urlsplit(self._service.url)
        endpoint_url = f"{endpoint.scheme}://{endpoint.netloc}{endpoint.path}".rstrip("/")
        self.endpoint = redact(endpoint_url, credentials.secrets)
        self.description = redact(
            "/".join(p for p in (endpoint_url, location.container, location.prefix) if p),
            credentials.secrets,
        )
        self._container = self._service.get_container_client(location.container)
        # Single-shot puts go straight through the container client's pipeline (signing,
        # retries, hooks and transport all the SDK's own): making a BlobClient per key costs more
        # client CPU than the rest of put together. Falls back to BlobClient.upload_blob if a
        # future SDK drops the attribute.
        self._pipeline = getattr(self._container, "_pipeline", None)
        self._container_url = self._container.url.split("?", 1)[0].rstrip("/")
        self._api_version = self._container.api_version
        self._name_prefix = f"{location.prefix}/" if location.prefix else ""
        # What this store last saw of each blob (from list, get, put or a conflict read): the
        # ETag to make the next put conditional on, and the version stamp (mtime_ns) behind it.
        self._seen: dict[str, ObjectInfo] = {}
        self._opened = False
        self._closed = False

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "", env: Mapping[str, str] | None = None, **options: Any
    ) -> "AzureBlobStore":
        """A store for ``SIDECAR_STORE=url`` and ``SIDECAR_PREFIX=prefix`` (not yet opened).

        ``env`` (default ``os.environ``) supplies the credentials; ``options`` tune transfer and
        retries (``max_single_put_size``, ``max_block_size``, ``max_concurrency``,
        ``retry_total``, ``retry_backoff``, ``connection_timeout``, ``read_timeout``; anything
        else goes to the SDK client, e.g. ``raw_request_hook``).
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
        return cls(location, _pick_credentials(env, location.account, location.sas), **options)

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
              last_modified: Any) -> ObjectInfo:
        md = {k.lower(): v for k, v in (metadata or {}).items()}
        etag = _quoted_etag(etag)
        try:
            sha = md[META_SHA256]
            if _SHA256_RE.match(sha):
                return ObjectInfo(key, size, sha, int(md[META_MTIME]), int(md[META_MODE], 8) & 0o7777, etag)
        except (KeyError, ValueError, TypeError):
            pass
        mtime_ns = int(last_modified.timestamp() * 1_000_000_000) if last_modified is not None else 0
        return ObjectInfo(key, size, None, mtime_ns, FOREIGN_MODE, etag)

    def _where(self) -> str:
        return f"Azure Blob store (account {self.account!r}, container {self.container_name!r})"

    def _error(self, e: BaseException, doing: str) -> StoreError:
        """One clear, secret-free line for an SDK failure; transient when retrying can help."""
        where = self._where()
        creds = self._creds
        status = getattr(e, "status_code", None)
        code = str(_code(e) or "") or None
        tag = " ".join(str(x) for x in (status, code) if x)
        detail = f" ({tag})" if tag else ""
        sdk_line = _one_line(getattr(e, "message", None) or str(e), 160)

        def done(cls: type[StoreError], text: str) -> StoreError:
            return cls(redact(_one_line(f"{where}: {doing} failed: {text}", 600), creds.secrets))

        if isinstance(e, ClientAuthenticationError) and status is None:
            # The credential itself could not get a token (no identity here, or a bad one).
            return done(
                StoreError,
                f"no usable Azure credential via {creds.source} ({sdk_line}); set "
                "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, "
                "or give the pod a managed/workload identity (AZURE_CLIENT_ID for a user-assigned one)",
            )
        if status in (401, 403) or isinstance(e, ClientAuthenticationError):
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
        if status in TRANSIENT_STATUS or (status == 409 and code == "ContainerBeingDeleted"):
            kind = "throttled" if status in (429, 503) else "service error"
            return done(TransientStoreError, f"{kind}{detail} after {self._retry_total} retries; will retry later")
        if code in ("Md5Mismatch", "Crc64Mismatch"):
            return done(TransientStoreError, f"the data was corrupted in transit{detail}; will retry")
        if isinstance(e, ResourceModifiedError):
            return done(TransientStoreError, f"the blob changed while it was read{detail}; will retry")
        if isinstance(e, (ServiceRequestError, ServiceResponseError)) or status is None:
            return self._connection_error(e, done)
        return done(StoreError, f"{sdk_line}{detail}")

    def _connection_error(self, e: BaseException, done) -> StoreError:
        endpoint = self.endpoint
        chain = list(_cause_chain(e))
        if any(isinstance(x, (ssl.SSLError, ssl.CertificateError)) or "SSL" in type(x).__name__
               or "Certificate" in type(x).__name__ for x in chain):
            return done(StoreError, f"TLS failure talking to {endpoint}; check the URL scheme and host, "
                                    "the CA bundle (SSL_CERT_FILE) and any TLS-intercepting proxy")
        dns = any(isinstance(x, socket.gaierror) or type(x).__name__ == "ClientConnectorDNSError" for x in chain)
        refused = any(isinstance(x, ConnectionRefusedError) for x in chain)
        timeout = any(isinstance(x, TimeoutError) or "Timeout" in type(x).__name__ for x in chain)
        what = ("cannot resolve the host" if dns else "connection refused" if refused
                else "timed out" if timeout else "connection failed")
        if not self._opened and (dns or refused):
            # Never reached the service at all: a wrong account name, endpoint or port.
            check = ("check the account name in SIDECAR_STORE (or the connection string's endpoint) "
                     "and DNS / private-endpoint resolution") if dns else \
                    "check the endpoint host and port are right and the service is running and reachable"
            return done(StoreError, f"{what} for {endpoint}; {check}")
        return done(TransientStoreError, f"{what} for {endpoint} after {self._retry_total} retries; "
                                         "check network reachability (firewall, proxy); will retry later")

    async def _put_blob(self, name: str, data: bytes, md5: bytes, metadata: dict[str, str],
                        etag: str | None) -> str | None:
        """One Put Blob request, conditional on ``etag`` (or on absence); returns the new ETag."""
        headers = {
            "x-ms-version": self._api_version,
            "x-ms-blob-type": "BlockBlob",
            "Content-Length": str(len(data)),
            "Content-Type": "application/octet-stream",
            "Content-MD5": base64.b64encode(md5).decode(),
        }
        for k, v in metadata.items():
            headers["x-ms-meta-" + k] = v
        if etag:
            headers["If-Match"] = etag
        else:
            headers["If-None-Match"] = "*"
        url = f"{self._container_url}/{quote(name, safe='~/')}"
        request = HttpRequest("PUT", url, headers=headers, content=data)
        response = (await self._pipeline.run(request, stream=False)).http_response
        status = response.status_code
        if status == 201:
            return response.headers.get("ETag")
        code = response.headers.get("x-ms-error-code")
        if status == 412 or (status == 409 and code == "BlobAlreadyExists"):
            raise _Conflict()
        err = HttpResponseError(message=f"{status} {code or response.reason}", response=response)
        err.error_code = code
        raise err

    # -- interface -----------------------------------------------------------------------------
    async def open(self) -> None:
        """Check the credentials and the container (one list request); create it when missing."""
        try:
            try:
                async for _ in self._container.list_blobs(name_starts_with=self._name_prefix or None,
                                                          results_per_page=1):
                    break
            except ResourceNotFoundError as e:
                if _code(e) != "ContainerNotFound":
                    raise
                try:
                    await self._container.create_container()
                    log.info("created container %s", self.container_name)
                except ResourceExistsError:
                    pass  # another sidecar made it meanwhile
                except AzureError as e2:
                    raise self._error(e2, "creating the missing container") from None
        except AzureError as e:
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
        metadata = {META_SHA256: meta.sha256, META_MTIME: str(meta.mtime_ns), META_MODE: format(meta.mode & 0o7777, "o")}
        blob = _LazyBlobClient(self._container, name)
        seen = self._seen.get(name)
        if seen is not None and seen.sha256 is not None and seen.mtime_ns > meta.mtime_ns:
            return seen  # known newer already: a stale upload, superseded without a request
        etag = seen.etag if seen is not None else None
        single = len(data) <= self._max_single_put_size
        md5 = hashlib.md5(data).digest()  # once; the service checks it and keeps it as Content-MD5
        for _ in range(MAX_CONFLICT_ROUNDS):
            cond = {"if_match": etag} if etag else {"if_none_match": "*"}
            try:
                if single and self._pipeline is not None:
                    new_etag = await self._put_blob(name, data, md5, metadata, etag)
                else:
                    # Blocks carry their own Content-MD5 (checked per block); the whole-blob MD5
                    # is recorded on commit. Block IDs are random, so concurrent uploaders of the
                    # same blob never mix blocks; the commit is the conditional step.
                    resp = await blob.upload_blob(
                        data, length=len(data), overwrite=True, metadata=metadata,
                        validate_content=True, max_concurrency=self._max_concurrency,
                        content_settings=ContentSettings(content_md5=md5), **cond,
                    )
                    new_etag = resp.get("etag")
            except (_Conflict, ResourceModifiedError, ResourceExistsError):
                pass  # 412 / 409 BlobAlreadyExists: someone else wrote it
            except HttpResponseError as e:
                if _code(e) != "InvalidBlockList":
                    raise self._error(e, f"uploading {key!r}") from None
                # Another writer committed while we staged, discarding our blocks.
            except AzureError as e:
                raise self._error(e, f"uploading {key!r}") from None
            else:
                info = ObjectInfo(key, meta.size, meta.sha256, meta.mtime_ns, meta.mode & 0o7777, _quoted_etag(new_etag))
                self._seen[name] = info
                return info
            # Conflict: read what is there now, once, and decide.
            try:
                props = await blob.get_blob_properties()
            except ResourceNotFoundError as e:
                if _code(e) == "ContainerNotFound":
                    raise self._error(e, f"uploading {key!r}") from None
                self._seen.pop(name, None)
                etag = None  # deleted meanwhile: write it if still absent
                continue
            except AzureError as e:
                raise self._error(e, f"uploading {key!r}") from None
            current = self._info(key, props.size, props.metadata, props.etag, props.last_modified)
            self._seen[name] = current
            if current.sha256 is not None and current.mtime_ns > meta.mtime_ns:
                log.debug("upload of %r superseded by a newer version in the store", key)
                return current
            etag = current.etag
        raise TransientStoreError(redact(
            f"{self._where()}: uploading {key!r} failed: the blob kept changing under concurrent "
            "writers; will retry later", self._creds.secrets))

    async def _get_fast(self, key: str, name: str) -> tuple[bytes, ObjectInfo]:
        """One Get Blob request through the client's pipeline (auth, retries), headers read
        directly: a third of the SDK downloader's CPU per blob."""
        url = f"{self._container_url}/{quote(name, safe='~/')}"
        request = HttpRequest("GET", url, headers={"x-ms-version": self._api_version})
        # stream=True keeps the pipeline's content decoder off the (binary) body
        response = (await self._pipeline.run(request, stream=True)).http_response
        await response.load_body()
        status = response.status_code
        if status != 200:
            code = response.headers.get("x-ms-error-code")
            if status == 404 and code != "ContainerNotFound":
                self._seen.pop(name, None)
                raise NotFound(key)
            cls = ResourceNotFoundError if status == 404 else HttpResponseError
            err = cls(message=f"{status} {code or response.reason}", response=response)
            err.error_code = code
            raise err
        data = response.body()
        headers = response.headers
        md = {k[len("x-ms-meta-"):]: v for k, v in headers.items() if k.lower().startswith("x-ms-meta-")}
        modified = headers.get("Last-Modified")
        info = self._info(key, len(data), md, headers.get("ETag"),
                          parsedate_to_datetime(modified) if modified else None)
        self._seen[name] = info
        return data, info

    async def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        name = self._name(key)
        if self._pipeline is not None:
            try:
                return await self._get_fast(key, name)
            except AzureError as e:
                raise self._error(e, f"downloading {key!r}") from None
        try:
            downloader = await self._container.get_blob_client(name).download_blob(
                max_concurrency=self._max_concurrency
            )
            data = await downloader.readall()
        except ResourceNotFoundError as e:
            if _code(e) == "ContainerNotFound":
                raise self._error(e, f"downloading {key!r}") from None
            self._seen.pop(name, None)
            raise NotFound(key) from None
        except AzureError as e:
            raise self._error(e, f"downloading {key!r}") from None
        props = downloader.properties
        info = self._info(key, len(data), props.metadata, props.etag, props.last_modified)
        self._seen[name] = info
        return data, info

    async def _list_fast(self, start: str) -> AsyncIterator[tuple[str, int, dict[str, str], str | None, Any]]:
        """List Blobs pages parsed with ElementTree: the SDK's generic XML deserializer costs about
        1 ms of CPU per blob, which dominated restores of a thousand files."""
        marker = ""
        while True:
            query = "restype=container&comp=list&include=metadata&maxresults=5000"
            if start:
                query += f"&prefix={quote(start, safe='')}"
            if marker:
                query += f"&marker={quote(marker, safe='')}"
            request = HttpRequest("GET", f"{self._container_url}?{query}", headers={"x-ms-version": self._api_version})
            response = (await self._pipeline.run(request, stream=False)).http_response
            if response.status_code != 200:
                code = response.headers.get("x-ms-error-code")
                err = HttpResponseError(message=f"{response.status_code} {code or response.reason}", response=response)
                err.error_code = code
                if response.status_code == 404:
                    raise ResourceNotFoundError(message=err.message, response=response)
                raise err
            root = ElementTree.fromstring(response.body())
            for blob in root.iterfind("Blobs/Blob"):
                name_el = blob.find("Name")
                name = name_el.text or ""
                if name_el.get("Encoded", "").lower() == "true":
                    name = unquote(name)
                props = blob.find("Properties")
                size = int(props.findtext("Content-Length") or 0)
                etag = props.findtext("Etag")
                modified = props.findtext("Last-Modified")
                md_el = blob.find("Metadata")
                md = {child.tag: child.text or "" for child in md_el} if md_el is not None else {}
                yield name, size, md, etag, parsedate_to_datetime(modified) if modified else None
            marker = root.findtext("NextMarker") or ""
            if not marker:
                return

    async def _list_sdk(self, start: str) -> AsyncIterator[tuple[str, int, dict[str, str], str | None, Any]]:
        pages = self._container.list_blobs(name_starts_with=start or None, include=["metadata"], results_per_page=5000)
        async for props in pages:
            yield props.name, props.size, props.metadata or {}, props.etag, props.last_modified

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        start = self._name_prefix + prefix
        cut = len(self._name_prefix)
        source = self._list_fast if self._pipeline is not None else self._list_sdk
        try:
            async for name, size, md, etag, modified in source(start):
                if not name.startswith(start) or name.endswith("/"):
                    continue  # directory placeholders (hierarchical namespace accounts)
                if str(md.get("hdi_isfolder", "")).lower() == "true":
                    continue
                info = self._info(name[cut:], size, md, etag, modified)
                self._seen[name] = info
                yield info
        except AzureError as e:
            raise self._error(e, f"listing {prefix!r}") from None

    async def delete(self, key: str) -> None:
        name = self._name(key)
        try:
            await self._container.delete_blob(name, delete_snapshots="include")
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
            await self._service.close()
        finally:
            if self._creds.owned is not None:
                await self._creds.owned.close()

    async def __aenter__(self) -> "AzureBlobStore":
        await self.open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
