"""The durable store interface every backend implements.

One small async interface, in the spirit of Litestream's ``ReplicaClient``: put a whole object with
its metadata, get it back, list by prefix with metadata in one pass, delete. Keys are relative to
the store's own prefix (``SIDECAR_PREFIX``) and always ``/``-separated; the store never interprets
them beyond joining them to its prefix. Backends live one per module next to this one, are chosen by
the store URL's scheme (:mod:`sidecar.store.registry`) and all pass ``tests/store/test_contract.py``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from types import TracebackType
from typing import AsyncIterator, Iterator, NamedTuple, Protocol, runtime_checkable

import anyio

from sidecar import log

#: Chunk size of streamed reads and writes (objects too large to hold whole: see ``Source``).
CHUNK_BYTES = 4 * 1024 * 1024


#: Keys of the sidecar's own objects (owner marker, snapshot bundles) begin with this segment;
#: no root may be called like it (``paths.RESERVED_NAMES``).
OWN_NAMESPACE = ".sidecar"


#: Bits of a version below the generation: one sidecar's writes (2^40 of them).
VERSION_COUNTER_BITS = 40
#: A stored version whose generation is above this is malformed: no sidecar wrote it (the
#: generations of versions below 2^63 would run out). It neither raises a claim's generation
#: (``fence.counted_version``) nor keeps a key from being replaced (:func:`supersedes`).
MAX_FLOOR_GENERATION = 2**22


def sane_version(version: int) -> bool:
    """Whether a sidecar could have written ``version`` (its generation is in range)."""
    return version >= 0 and version >> VERSION_COUNTER_BITS <= MAX_FLOOR_GENERATION


#: Keys already warned about by :func:`supersedes` (a warning per key, for the first ones).
_WARNED = log.Once(limit=1024)


def supersedes(stored: "ObjectInfo", version: int) -> bool:
    """The supersede rule of :meth:`Store.put`, shared by every backend: whether the stored object
    must not be replaced by a write at ``version`` (its version is higher). A stored version no
    sidecar could have written (:func:`sane_version`: set by hand, blob metadata anyone with write
    access may change) counts as none, so it never freezes its key; a warning names the key once."""
    if stored.version <= version:
        return False
    if sane_version(stored.version):
        return True
    if _WARNED.first(stored.key):
        log.warning("stored_version_malformed", key=log.printable(stored.key), version=stored.version,
                    detail="the stored object's version is out of the range a sidecar writes (set by something "
                           "else): it is replaced as if it had none")
    return False


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What the sidecar records about a file besides its bytes."""

    size: int
    sha256: str  # hex digest of the bytes
    mtime_ns: int  # the file's, restored with it; never used to order versions
    mode: int  # permission bits only (0o7777)
    #: orders writes of one key: a put never replaces a higher version (see :meth:`Store.put`).
    #: Assigned by the writing sidecar (its fence generation and a counter), never from a clock.
    version: int = 0

    @classmethod
    def of(cls, data: bytes, mtime_ns: int, mode: int, version: int = 0) -> "ObjectMeta":
        return cls(len(data), hashlib.sha256(data).hexdigest(), mtime_ns, mode & 0o7777, version)


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """An object as the store holds it. ``sha256`` is None when the store cannot vouch for it."""

    key: str
    size: int
    sha256: str | None
    mtime_ns: int
    mode: int
    etag: str | None = None
    version: int = 0  # 0: written without one (an older release, another tool)
    #: when the store last wrote the object, in seconds since the epoch by the *store's* clock
    #: (Azure's Last-Modified; the directory store's time of the put, kept in its record): stable
    #: until the object is written again. None when not known. Compared only with other times of
    #: the same store, never with a local clock.
    modified: float | None = None
    #: as listed: another client holds a lease on it, so it cannot be written or deleted until that
    #: lease is released or broken (Azure; other stores have none)
    leased: bool = False

    def same_content(self, meta: ObjectMeta) -> bool:
        return self.sha256 == meta.sha256 and self.size == meta.size

    def same_as(self, meta: ObjectMeta) -> bool:
        """Content, mtime and mode all match: uploading ``meta`` again would change nothing."""
        return self.same_content(meta) and self.mtime_ns == meta.mtime_ns and self.mode == meta.mode


class Source(Protocol):
    """Bytes too large to hold whole, read in chunks of at most :data:`CHUNK_BYTES`, as often as
    a store needs. A read raises after its last chunk when the bytes were not the ones hashed into
    the put's ``meta`` (the file changed): the store must then leave the object as it was."""

    size: int
    md5: bytes  # of the whole content

    def chunks(self) -> AsyncIterator[bytes]: ...

    def iter_sync(self) -> Iterator[bytes]: ...


class Stream(NamedTuple):
    """What :meth:`Store.get_stream` returns: the object's info and its chunks. It closes itself:
    ``async with await store.get_stream(key) as (info, chunks):`` closes the chunks when the block
    is left, read to the end or not (unpacked as ``info, chunks = ...`` instead, the caller closes
    them: :meth:`aclose`)."""

    info: "ObjectInfo"
    chunks: AsyncIterator[bytes]

    async def aclose(self) -> None:
        await close_chunks(self.chunks)

    async def __aenter__(self) -> "Stream":
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


async def close_chunks(chunks: AsyncIterator[bytes]) -> None:
    """Close a stream's chunks before their end (an iterator without ``aclose`` holds nothing),
    shielded: a cancelled task still releases the connection or file."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


class StoreError(Exception):
    """A failure that retrying will not fix (bad credentials, missing permission, bad URL).

    The message is one line, names what to check, and never contains a secret.
    """


class TransientStoreError(StoreError):
    """A failure worth retrying: throttling, timeouts, connection refused, 5xx."""


class StoreFull(TransientStoreError):
    """The store is out of space (or quota): nothing was written. Retried often (see
    ``retry.Retry``), so that the backlog drains within seconds of space coming back."""


class NotFound(StoreError):
    """The object does not exist."""


@runtime_checkable
class Store(Protocol):
    #: Where the store is, for logs and errors; never contains a secret.
    description: str

    @property
    def flat_namespace(self) -> bool:
        """Whether keys are names, not paths: ``a`` and ``a/x`` can be stored at once (a file
        replaced by a directory, before the file's object is deleted) and :meth:`list` comes in
        name order, so the restore decides between the two shapes as it lists
        (:class:`sidecar.plan.ShapeConflicts`). Azure: True; the directory store: False."""

    @property
    def clock_is_local(self) -> bool:
        """Whether :meth:`now` has fallen back to this machine's clock (the directory store where
        it cannot make a file to read the store's): ``prune`` then refuses to judge ages by it.
        False until :meth:`now` says otherwise; a store that tells its own clock: always False."""

    async def open(self) -> None:
        """Connect and check the store is usable (create the container or directory if allowed)."""

    async def put(self, key: str, data: bytes | Source, meta: ObjectMeta, if_version: int | None = None, *,
                  expected: ObjectInfo | None = None) -> ObjectInfo:
        """Store ``data`` under ``key`` atomically: readers see the old object or the new, whole.
        A :class:`Source` is streamed, never held whole; when its read fails, nothing changes.
        With ``if_version``, write only if the stored object is at exactly that version (0: none
        stored): a compare-and-swap, for the owner marker; otherwise the stored info is returned.

        Supersede rule (:func:`supersedes`): when the stored object's ``version`` is higher than
        ``meta.version`` (and one a sidecar could have written), nothing is written and the
        stored object's info is returned (``info.version`` tells the caller): an older upload
        never replaces a newer one, whichever finishes last. The check and the write are one
        atomic step (a conditional write, or a lock).

        ``expected``: what the caller believes the store holds under ``key``, the
        :class:`ObjectInfo` a list, get or put of this backend last returned for it (None: absent,
        or not known). It only makes the write cheaper (Azure: one conditional request on its
        ``etag``) and never changes the outcome: when it is stale, the store finds out and
        decides by what it holds. A store keeps nothing per key between calls; the caller's
        belief is the caller's (``known.StoreState``, the fence's last marker)."""

    async def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        """The object's bytes and metadata; :class:`NotFound` when absent."""

    async def get_stream(self, key: str, read_ahead: int = 0) -> Stream:
        """The object's metadata and its bytes in chunks of at most :data:`CHUNK_BYTES` (for
        objects too large to hold); :class:`NotFound` when absent. The :class:`Stream` closes
        itself (``async with``); unpacked, iterate the chunks to the end or close them.
        ``read_ahead``: a remote store fetches up to that many further chunks while one is
        consumed (that many chunks more in memory), so a large object streams at the store's pace
        rather than one round trip a chunk; a local one may ignore it."""

    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, with metadata, in one paged pass, in
        key order (by code point, as Azure lists blobs): a namespace's objects come together, and
        ``sessions`` lists namespaces in the same order whatever the store."""

    async def delete(self, key: str) -> None:
        """Remove ``key``; deleting a missing object is not an error."""

    async def delete_if(self, key: str, version: int) -> bool:
        """Remove ``key`` only while the store holds it at exactly ``version``, the check and the
        removal one atomic step (Azure: a delete conditional on the ETag just read; the directory
        store: under the key's lock); True when it was removed. For the owner marker
        (``checkpoint-sidecar prune`` removes it last, only while it is still prune's)."""

    async def exists(self) -> bool:
        """Whether the store itself is there (the directory store's directory, the Azure
        container), which a read-only store cannot tell by listing (it lists as empty without it).
        Reads only; a backend that cannot tell says True."""
        return True

    async def now(self) -> float:
        """The store's current time, in seconds since the epoch by the *store's* clock (the one
        :attr:`ObjectInfo.modified` is read on), so that the age of an object is told without
        comparing two machines' clocks. Azure: the ``Date`` of a response; the directory store:
        the change time of a temp file it makes and removes (this machine's clock, said once in a
        warning, where it cannot make one)."""

    async def aclose(self) -> None:
        """Release connections and credentials."""
