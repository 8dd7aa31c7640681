"""The Azure Blob store's rules: one container, an optional prefix, block blobs with our metadata.

Each object is one block blob whose metadata carries ``sidecar_sha256``, ``sidecar_mtime_ns``,
``sidecar_mode`` and ``sidecar_version``. ``sidecar_version`` (never a clock) orders writes in the
conditional-write rule that keeps a stale upload from replacing a newer one (see
:meth:`AzureBlobStore.put`); every write is conditional on an ETag the caller passes or on the
blob's absence, so the store keeps nothing per blob between calls. Each blob's Content-MD5 is
recorded, and every request's body is checked by the service (transactional MD5).

Every request goes through ``azure-storage-blob`` (``azure.storage.blob.aio``): one
``BlobServiceClient`` per store on one aiohttp session whose connection pool holds
``2 * concurrency`` connections (:func:`pool_size`). The URL is parsed by
:mod:`~sidecar.store.azure.location`, the credential picked by :mod:`~sidecar.store.azure.credentials`,
the proxy by :mod:`sidecar.store.proxy` (once per store), failures said by
:mod:`~sidecar.store.azure.errors`, requests retried by :mod:`~sidecar.store.azure.retry`; an
object's metadata written and read back by :mod:`~sidecar.store.azure.metadata`, one conditional
upload made by :mod:`~sidecar.store.azure.upload`.
``docs/AZURE-STORE.md`` gives the reasons.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
from email.utils import parsedate_to_datetime
from typing import Any, AsyncIterator, Callable, Mapping
from urllib.parse import urlsplit

import aiohttp
from azure.core import MatchConditions
from azure.core.exceptions import AzureError, ResourceExistsError, ResourceModifiedError, ResourceNotFoundError
from azure.core.pipeline.transport import AioHttpTransport
from azure.storage.blob.aio import BlobServiceClient, ContainerClient

from sidecar import log
from sidecar.paths import MAX_KEY_BYTES, UnsafeKey, validate_relpath
from sidecar.store.azure.credentials import Credentials, pick_credentials
from sidecar.store.azure.errors import Where, error_code, store_error
from sidecar.store.azure.location import BlobLocation
from sidecar.store.azure.metadata import blob_metadata, listed, object_info, quoted_etag
from sidecar.store.azure.retry import Retry
from sidecar.store.azure.upload import Conflict, put_blob
from sidecar.store.base import (
    CHUNK_BYTES,
    NotFound,
    ObjectInfo,
    ObjectMeta,
    Source,
    StoreError,
    Stream,
    TransientStoreError,
    supersedes,
)
from sidecar.store.proxy import proxy_for

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

#: The most bytes of an answer's body read from the connection at once (the SDK's own default when it
#: makes the transport; one made here would read 4 KiB at a time: a thousand reads per chunk).
READ_BLOCK = 256 * 1024

#: Connections per operation in flight (see :func:`pool_size`).
POOL_PER_OPERATION = 2


def pool_size(concurrency: int) -> int:
    """The connection pool of a store running ``concurrency`` operations at once: one connection
    for each, and as many again for what runs beside them (the listing's next page during a
    restore's downloads, the owner marker, a bundle staged in parallel blocks). The default
    ``SIDECAR_CONCURRENCY`` of 16 gives 32."""
    return max(1, concurrency) * POOL_PER_OPERATION


class AzureBlobStore:
    """A :class:`~sidecar.store.base.Store` on one Azure Blob container (or Azurite)."""

    #: Blob names are not paths: ``a`` and ``a/x`` can be stored at once (a file replaced by a
    #: directory, before the file's blob is deleted), and the listing comes in name order. The
    #: restore decides between the two shapes (:class:`sidecar.plan.ShapeConflicts`).
    flat_namespace = True
    #: :meth:`now` is the service's clock (a response's ``Date``), never this machine's.
    clock_is_local = False

    def __init__(
        self,
        location: BlobLocation,
        credentials: Credentials,
        *,
        concurrency: int = 16,
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
        self.endpoint = log.redact(endpoint_url, credentials.secrets)
        self.description = log.redact(
            "/".join(p for p in (endpoint_url, location.container, location.prefix) if p), credentials.secrets
        )
        self._proxy = proxy_for(parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80),
                                os.environ if proxy_env is None else proxy_env)
        self._secrets = credentials.secrets + (self._proxy.secrets if self._proxy is not None else ())
        self._endpoint_url = endpoint_url
        self._client_settings = dict(pool=pool_size(concurrency), retry_total=retry_total, retry_backoff=retry_backoff,
                                     connection_timeout=connection_timeout, read_timeout=read_timeout, hook=request_hook)
        self._service: BlobServiceClient | None = None
        self._container: ContainerClient | None = None
        self._name_prefix = f"{location.prefix}/" if location.prefix else ""
        self._where = Where(self.account, self.container_name, self.endpoint, credentials.source,
                            credentials.hint(self.account), self._proxy, retry_total, self._secrets)
        self._opened = False
        self._first_page: tuple[list[Any], str | None] | None = None  # open()'s page and its continuation
        self._closed = False

    @classmethod
    def at(cls, location: BlobLocation, env: Mapping[str, str] | None = None, **options: Any) -> "AzureBlobStore":
        """A store at ``location`` (a URL the registry parsed, its prefix included; not yet
        opened), with the credentials of ``env`` (default ``os.environ``). ``options`` tune the
        client (``concurrency``: operations in flight, which sizes the connection pool;
        ``retry_total``, ``retry_backoff``, ``connection_timeout``, ``read_timeout``,
        ``request_hook(method, path)`` called for every request sent, ``create=False`` for a
        read-only use such as ``status``: a missing container lists as empty and is not created).
        The proxy, if any, comes from ``env`` too (:func:`~sidecar.store.proxy.proxy_for`).
        Raises ValueError, without any secret in the message, for a bad credential or proxy."""
        env = os.environ if env is None else env
        options.setdefault("proxy_env", env)
        # Checked before a credential object exists that an error would leave open.
        proxy_for(location.scheme, "", 0, env)
        creds = pick_credentials(env, location.account, location.sas, location.scheme,
                                 float(options.get("connection_timeout", 10)))
        if creds.source == "DefaultAzureCredential":
            creds.secrets = tuple(s for s in (env.get("IDENTITY_HEADER"), env.get("AZURE_CLIENT_SECRET")) if s)
        return cls(location, creds, **options)

    # -- helpers -------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"AzureBlobStore({self.description!r}, credential={self.credential_source!r})"

    def _container_client(self) -> ContainerClient:
        """The store's one SDK client, made on first use (its aiohttp session needs the event loop).

        One session for every request: a connection pool of :func:`pool_size` connections,
        the environment not consulted per request (``trust_env=False``: no ``.netrc`` or proxy
        look-up on each; the proxy is chosen once, by :func:`proxy_for`), no cookies, bodies
        not decompressed.
        """
        if self._container is None:
            if self._closed:
                raise StoreError(f"{self._where}: the store is closed")
            s: dict[str, Any] = self._client_settings
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=s["pool"]), trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
            )
            options: dict[str, Any] = dict(
                transport=AioHttpTransport(session=session, session_owner=True, connection_data_block_size=READ_BLOCK,
                                           connection_timeout=s["connection_timeout"], read_timeout=s["read_timeout"]),
                retry_policy=Retry(s["retry_backoff"], s["retry_total"]),
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

    def _error(self, e: BaseException, doing: str) -> StoreError:
        """One clear, secret-free line for a failed operation (:func:`~sidecar.store.azure.errors.store_error`)."""
        return store_error(e, doing, self._where, self._opened)

    async def _page(self, start: str, token: str | None, size: int) -> tuple[list[Any], str | None]:
        """One page of the listing (blob properties with metadata) and the token of the next."""
        pages = self._container_client().list_blobs(
            name_starts_with=start or None, include=["metadata"], results_per_page=size,
        ).by_page(continuation_token=token)
        page = await pages.__anext__()
        return [props async for props in page], pages.continuation_token or None  # type: ignore[attr-defined]

    async def _put_blob(self, name: str, data: "bytes | Source", md5: bytes, metadata: dict[str, str],
                        etag: str | None, staged: bool = False) -> str | None:
        """One conditional upload of blob ``name`` (:func:`~sidecar.store.azure.upload.put_blob`)."""
        return await put_blob(self._container_client().get_blob_client(name), data, md5, metadata, etag, staged)

    # -- interface -----------------------------------------------------------------------------
    async def open(self) -> None:
        """Check the credentials and the container with one list request, the first page of the
        listing a start-up makes next (kept for that :meth:`list`, so it costs no extra round
        trip); create the container when missing (unless ``create`` is off: then it lists as empty)."""
        try:
            try:
                self._first_page = await self._page(self._name_prefix, None, FIRST_PAGE_RESULTS)
            except ResourceNotFoundError as e:
                if error_code(e) != "ContainerNotFound":
                    raise
                if not self.create:
                    self._first_page = ([], None)
                    self._opened = True
                    return
                try:
                    await self._container_client().create_container()
                    log.info("container_created", store=self.description)
                except ResourceExistsError as e2:
                    if error_code(e2) != "ContainerAlreadyExists":
                        raise
        except AzureError as e:
            raise self._error(e, "opening the store") from None
        self._opened = True

    async def put(self, key: str, data: bytes | Source, meta: ObjectMeta, if_version: int | None = None, *,
                  expected: ObjectInfo | None = None) -> ObjectInfo:
        """Upload ``data`` unless the store holds a newer version of ``key`` (or, with
        ``if_version``, unless it holds any other version than that: a compare-and-swap).

        Conditional-write rule, with ``sidecar_version`` as the version: the write is conditional
        on ``expected``'s ETag (``If-Match``), or on the blob's absence (``If-None-Match: *``)
        without one, so a caller that passes what it last saw pays exactly one request. When the
        condition fails (412/409), the blob's properties are read once: if the stored version is
        higher than ``meta.version`` nothing is written and the stored object's
        :class:`ObjectInfo` is returned (the caller sees ``info.version > meta.version``);
        otherwise the write is retried against the fresh ETag. An ``expected`` that already
        settles the outcome (a higher version, or another than ``if_version``), or a swap with no
        ``expected``, reads first instead of writing. Versions of a blob therefore never go
        backwards, whichever writer (or store object) finishes first. A blob without a version
        (an older release's, another tool's) has version 0.
        """
        name = self._name(key)
        self._first_page = None  # a listing from before this write must not be served after it
        metadata = blob_metadata(meta)
        etag = expected.etag if expected is not None else None
        if expected is None:
            read_first = bool(if_version)  # a swap against an object not known: look first
        else:
            read_first = supersedes(expected, meta.version) or (if_version is not None and expected.version != if_version)
        md5 = hashlib.md5(data).digest() if isinstance(data, bytes) else data.md5
        staged = False  # bytes go up as blocks: a dead upload's uncommitted blocks are in the way
        try:
            for _ in range(MAX_CONFLICT_ROUNDS):
                wrote = not read_first
                if wrote:
                    try:
                        new_etag = await self._put_blob(name, data, md5, metadata, etag, staged)
                    except Conflict:
                        pass
                    else:
                        return ObjectInfo(key, meta.size, meta.sha256, meta.mtime_ns, meta.mode & 0o7777,
                                          quoted_etag(new_etag), meta.version)
                read_first = False
                # Conflict (or a belief to check): read what is there now, once, and decide.
                try:
                    props = await self._container_client().get_blob_client(name).get_blob_properties()
                except ResourceNotFoundError as e:
                    if error_code(e) == "ContainerNotFound":
                        raise
                    if if_version not in (None, 0):
                        return ObjectInfo(key, 0, None, 0, 0)  # not there: the swap is refused
                    # "exists" to If-None-Match, yet no blob: only uncommitted blocks are there
                    staged = staged or (wrote and etag is None)
                    etag = None  # deleted meanwhile: write it if still absent
                    continue
                current = object_info(key, props.size, props.metadata, props.etag, props.last_modified)
                if if_version is not None and current.version != if_version:
                    return current  # changed since it was read: the swap is refused
                if supersedes(current, meta.version):
                    log.debug("upload_superseded", key=key, detail="a newer version is in the store")
                    return current
                etag = current.etag
        except AzureError as e:
            raise self._error(e, f"uploading {key!r}") from None
        raise TransientStoreError(log.redact(
            f"{self._where}: uploading {key!r} failed: the blob kept changing under concurrent "
            "writers; will retry later", self._secrets))

    async def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        downloader = await self._download(key)
        try:
            data = await downloader.readall()
        except AzureError as e:
            raise self._download_failed(e, key) from None
        props = downloader.properties
        if props.size is not None and props.size != len(data):
            raise self._cut_short(key)
        return data, object_info(key, len(data), props.metadata, props.etag, props.last_modified)

    async def get_stream(self, key: str, read_ahead: int = 0) -> Stream:
        downloader = await self._download(key)
        props = downloader.properties
        info = object_info(key, props.size, props.metadata, props.etag, props.last_modified)
        if read_ahead > 0 and props.size > CHUNK_BYTES:
            return Stream(info, self._ranges(key, downloader, read_ahead))

        async def chunks() -> AsyncIterator[bytes]:
            got = 0
            try:
                async for chunk in downloader.chunks():
                    got += len(chunk)
                    yield chunk
            except AzureError as e:
                raise self._download_failed(e, key) from None
            if got != props.size:
                raise self._cut_short(key)

        return Stream(info, chunks())

    async def _ranges(self, key: str, downloader: Any, window: int) -> AsyncIterator[bytes]:
        """The blob's chunks, in order, with up to ``window`` ranged GETs of the next ones in
        flight while one is consumed (each pinned to the ETag the first answer carried: a blob
        rewritten meanwhile fails the read). The first chunk is the first answer's own bytes."""
        props = downloader.properties
        blob = self._container_client().get_blob_client(self._name(key))

        async def fetch(offset: int) -> bytes:
            length = min(CHUNK_BYTES, props.size - offset)
            d = await blob.download_blob(offset=offset, length=length, etag=props.etag,
                                         match_condition=MatchConditions.IfNotModified, max_concurrency=1)
            data = await d.readall()
            if len(data) != length:
                raise self._cut_short(key)
            return data

        offsets = iter(range(CHUNK_BYTES, props.size, CHUNK_BYTES))
        inflight: list[asyncio.Task[bytes]] = []
        try:
            try:
                first = await downloader.chunks().__anext__()  # bytes of the answer already read: no request
            except AzureError as e:
                raise self._download_failed(e, key) from None
            if len(first) != CHUNK_BYTES:
                raise self._cut_short(key)
            inflight = [asyncio.ensure_future(fetch(o)) for o in itertools.islice(offsets, window)]
            yield first
            while inflight:
                try:
                    chunk = await inflight.pop(0)
                except AzureError as e:
                    raise self._download_failed(e, key) from None
                if (nxt := next(offsets, None)) is not None:
                    inflight.append(asyncio.ensure_future(fetch(nxt)))
                yield chunk
        finally:  # closed early or failed: nothing left running
            for t in inflight:
                t.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)

    async def _download(self, key: str) -> Any:
        """Start downloading ``key``: the SDK's downloader, holding the properties."""
        name = self._name(key)
        try:
            return await self._container_client().download_blob(name, max_concurrency=1)
        except AzureError as e:
            raise self._download_failed(e, key) from None

    def _download_failed(self, e: AzureError, key: str) -> StoreError:
        """A missing blob is NotFound; a missing container, or anything else, is the store
        failing, except to a read-only store."""
        if isinstance(e, ResourceNotFoundError) and (error_code(e) != "ContainerNotFound" or not self.create):
            return NotFound(key)  # (read-only, a container not made yet holds nothing)
        return self._error(e, f"downloading {key!r}")

    def _cut_short(self, key: str) -> TransientStoreError:
        return TransientStoreError(log.redact(f"{self._where}: downloading {key!r} failed: the answer was cut "
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
                    if (info := listed(props, start, cut)) is not None:
                        yield info
                if token is None:
                    return
            pages = self._container_client().list_blobs(
                name_starts_with=start or None, include=["metadata"], results_per_page=PAGE_RESULTS,
            ).by_page(continuation_token=token)
            async for page in pages:
                async for props in page:
                    if (info := listed(props, start, cut)) is not None:
                        yield info
        except ResourceNotFoundError as e:
            if self.create or error_code(e) != "ContainerNotFound":
                raise self._error(e, f"listing {prefix!r}") from None
            return  # read-only: a container not made yet holds nothing
        except AzureError as e:
            raise self._error(e, f"listing {prefix!r}") from None

    async def list_names(self, prefix: str = "") -> AsyncIterator[str]:
        """The keys :meth:`list` gives, without their properties or metadata (the service's
        names-only listing: a smaller answer, and no properties to deserialise). A name ending in
        ``/`` is left out as there; a hierarchical account's folder (told by its metadata) is not
        told apart here, so a caller that must not see one lists in full."""
        start = self._name_prefix + prefix
        cut = len(self._name_prefix)
        try:
            async for name in self._container_client().list_blob_names(
                    name_starts_with=start or None, results_per_page=PAGE_RESULTS):
                if name.startswith(start) and not name.endswith("/"):
                    yield name[cut:]
        except ResourceNotFoundError as e:
            if self.create or error_code(e) != "ContainerNotFound":
                raise self._error(e, f"listing {prefix!r}") from None
        except AzureError as e:
            raise self._error(e, f"listing {prefix!r}") from None

    async def delete(self, key: str) -> None:
        name = self._name(key)
        self._first_page = None
        try:
            await self._container_client().delete_blob(name, delete_snapshots="include")
        except ResourceNotFoundError as e:
            if error_code(e) == "ContainerNotFound":
                raise self._error(e, f"deleting {key!r}") from None
        except AzureError as e:
            raise self._error(e, f"deleting {key!r}") from None

    async def delete_if(self, key: str, version: int) -> bool:
        """Delete ``key`` while it is at ``version``: its properties read, then a delete conditional
        on their ETag (``If-Match``); False when it is gone, at another version, or changed between."""
        name = self._name(key)
        self._first_page = None
        blob = self._container_client().get_blob_client(name)
        try:
            props = await blob.get_blob_properties()
            if object_info(key, props.size, props.metadata, props.etag, props.last_modified).version != version:
                return False
            await blob.delete_blob(delete_snapshots="include", etag=props.etag,
                                   match_condition=MatchConditions.IfNotModified)
        except ResourceModifiedError:
            return False
        except ResourceNotFoundError as e:
            if error_code(e) == "ContainerNotFound":
                raise self._error(e, f"deleting {key!r}") from None
            return False
        except AzureError as e:
            raise self._error(e, f"deleting {key!r}") from None
        return True

    async def exists(self) -> bool:
        """Whether the container is there: one listing page of one blob (a SAS scoped to the
        container may list but not read the container's properties)."""
        try:
            async for _ in self._container_client().list_blobs(results_per_page=1).by_page():
                break
        except ResourceNotFoundError as e:
            if error_code(e) == "ContainerNotFound":
                return False
            raise self._error(e, "looking for the container") from None
        except AzureError as e:
            raise self._error(e, "looking for the container") from None
        return True

    async def now(self) -> float:
        """The service's clock: the ``Date`` header of one request (the container's properties;
        a missing container answers with one too)."""
        dates: list[str] = []

        def seen(response: Any) -> None:
            if date := response.http_response.headers.get("Date"):
                dates.append(date)

        try:
            await self._container_client().get_container_properties(raw_response_hook=seen)
        except ResourceNotFoundError:
            pass
        except AzureError as e:
            if not dates:
                raise self._error(e, "reading the store's clock") from None
        try:
            return parsedate_to_datetime(dates[-1]).timestamp()
        except (IndexError, TypeError, ValueError):
            raise StoreError(f"{self._where}: reading the store's clock: no Date header in the answer") from None

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
