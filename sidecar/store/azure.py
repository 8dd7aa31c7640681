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
import logging
import re
from email.utils import parsedate_to_datetime
from typing import Any, AsyncIterator, Callable, Mapping
from urllib.parse import quote, unquote
from xml.etree import ElementTree

from sidecar.paths import MAX_KEY_BYTES, UnsafeKey, validate_relpath
from sidecar.store import blobapi, early
from sidecar.store.azure_location import (  # noqa: F401 (parse_store_url, redact: part of this module's interface)
    BlobLocation, _Credentials, endpoint_of, list_query, parse_store_url, redact, resolve,
)
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

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def _quoted_etag(etag: str | None) -> str | None:
    """ETags as the service sends them in headers (quoted); listings give them bare."""
    if not etag:
        return None
    return etag if etag.startswith(('"', 'W/"')) else f'"{etag}"'


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------


class _Conflict(Exception):
    """A conditional write found the blob changed (412) or present (409 BlobAlreadyExists)."""


def _http_date(value: str | None) -> Any:
    if not value:
        return None
    try:
        return parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None


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
    ) -> None:
        self.location = location
        self.container_name = location.container
        self.prefix = location.prefix
        self._creds = credentials
        self.credential_source = credentials.source
        self._retry_total = retry_total
        endpoint_url = credentials.endpoint or location.endpoint  # a connection string's replaces the URL's
        self.account = credentials.account or location.account
        self.endpoint = redact(endpoint_url, credentials.secrets)
        self.description = redact(
            "/".join(p for p in (endpoint_url, location.container, location.prefix) if p), credentials.secrets
        )
        base_url, base_path = endpoint_of(location, credentials)
        self._api = blobapi.BlobApi(
            base_url, base_path, credentials.auth, max_connections=max_concurrency,
            retry_total=retry_total, retry_backoff=retry_backoff, connection_timeout=connection_timeout,
            read_timeout=read_timeout, hook=request_hook,
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
        ``connection_timeout``, ``read_timeout``, ``request_hook``).
        Raises ValueError, without any secret in the message, for a bad URL or credential.
        """
        location, credentials = resolve(url, prefix, env)
        return cls(location, credentials, **options)

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
        endpoint = self.endpoint
        if e.kind == "tls":
            return done(StoreError, f"TLS failure talking to {endpoint}; check the URL scheme and host, "
                                    "the CA bundle (SSL_CERT_FILE) and any TLS-intercepting proxy")
        what = {"dns": "cannot resolve the host", "refused": "connection refused",
                "timeout": "timed out"}.get(e.kind, "connection failed")
        if not self._opened and e.kind in ("dns", "refused"):
            # Never reached the service at all: a wrong account name, endpoint or port.
            check = ("check the account name in SIDECAR_STORE (or the connection string's endpoint) "
                     "and DNS / private-endpoint resolution") if e.kind == "dns" else \
                    "check the endpoint host and port are right and the service is running and reachable"
            return done(StoreError, f"{what} for {endpoint}; {check}")
        return done(TransientStoreError, f"{what} for {endpoint} after {self._retry_total} retries; "
                                         "check network reachability (firewall, proxy); will retry later")

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

    async def _list_page(self, start: str, marker: str) -> bytes:
        return (await self._api.request("GET", self._container_path, list_query(start, marker))).body

    # -- interface -----------------------------------------------------------------------------
    async def open(self) -> None:
        """Check the credentials and the container with one list request, the first page of the
        listing a start-up makes next (kept for that :meth:`list`, so it costs no extra round
        trip); create the container when missing. The command line may have asked for that page
        already, while Python was importing (:mod:`sidecar.store.early`): then it is used."""
        early_page = early.take((self._api.base_url, self._container_path, self._name_prefix))
        if early_page is not None:
            import anyio.to_thread

            await anyio.to_thread.run_sync(early_page.done.wait, early.WAIT)
            if early_page.body is not None:
                self._first_page = early_page.body
                self._opened = True
                return
        try:
            try:
                self._first_page = await self._list_page(self._name_prefix, "")
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
                                     _http_date(h.get("last-modified")))
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
        info = self._info(key, len(data), response.metadata(), h.get("etag"), _http_date(h.get("last-modified")))
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
                info = self._info(name[cut:], size, md, etag, _http_date(modified))
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
