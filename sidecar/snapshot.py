"""Crash-consistent commits for roots whose files depend on each other (the AgentServer state root).

The host rewrites ``checkpoints`` and then ``workflow bindings`` (which points into the former) at
every superstep; a store holding the new bindings with the old checkpoints cannot be resumed. In
snapshot mode the store therefore only ever holds a state the disk really passed through:

1. **Snapshot.** Scan the root (size, mtime, ctime, inode of every file), read every dirty file,
   scan again. Equal scans mean nothing changed in between, so what was read is exactly the disk's
   state at one instant. Otherwise the batch is read again (the host's next write is coming).
   Files beyond the first :data:`HELD_MAX` bytes of the batch are only hashed then; every later
   read of one streams it from the disk and fails after its last chunk unless it is still that
   very version, and a put whose read fails stores nothing.
2. **Commit.** A batch of one change is a single atomic put or delete. A larger batch is first
   written as one *bundle* object (``.sidecar/bundles/<root>``: every changed file and deletion),
   then applied to the per-file objects, then the bundle is deleted. A crash after the bundle put
   (or a streamed file that changed before its own put) leaves the bundle behind, and restore lays
   it over the per-file objects older than it (by version: the commit's own puts come after the
   bundle): either the old state or the new one is restorable, never a mix. The root's next
   commit replaces that bundle with the disk's newer state. A batch larger than a bundle may be
   (:data:`MAX_BUNDLE_ENTRIES`, :data:`MAX_HEADER_BYTES`) is committed in parts.

Bundles are written and read as streams (:func:`bundle_chunks`, :class:`BundleSource`,
:class:`BundleReader`; the format is described below), so no file is ever held whole; the
pure helpers :func:`encode_bundle` and :func:`decode_bundle` do the same over bytes in hand. A
:class:`Committer` carries out the protocol for the uploader, which hands it each root's batch of
dirty keys and retries a batch that failed; it also deletes, at start-up, the bundles that
cut-short commits left behind (:meth:`Committer.drop_stale_bundles`). Per root, a commit's bundle
put..delete and that cleanup's delete never interleave (a lock per root).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, AsyncIterator, Callable, Coroutine, Iterator, TypeVar

import anyio
import anyio.to_thread

from sidecar import log, tarstream
from sidecar.known import StoreState
from sidecar.localfs import FileSource, TooLarge, Unstable, Vanished, absent, hash_stable, read_stable, scan_root
from sidecar.metrics import Totals
from sidecar.paths import IgnoreRules, Root, split_key
from sidecar.store.base import OWN_NAMESPACE, NotFound, ObjectInfo, ObjectMeta, Store, StoreError
from sidecar.tarstream import Member, TarReader, TarSource, drain, load_header, member_header, pad, tar_chunks

if TYPE_CHECKING:
    from sidecar.writer import Writer

BUNDLE_DIR = f"{OWN_NAMESPACE}/bundles"

#: A snapshot commit holds at most this many bytes of its files in memory (the first files of its
#: batch that fit); the others are hashed in the snapshot and streamed from the disk when stored.
HELD_MAX = 8 * 1024 * 1024
#: The first member of a bundle: its header (root, and every change's key and metadata).
MANIFEST_NAME = ".sidecar-bundle.json"
#: A bundle's header is read and parsed whole, so it is bounded (the archives' bounds,
#: :data:`sidecar.tarstream.MAX_HEADER_BYTES`, :data:`~sidecar.tarstream.MAX_ENTRIES`). A
#: commit's batch is bounded only by its root's file count, so the committer splits a larger
#: batch (:func:`bundle_parts`): no bundle written exceeds these.
MAX_HEADER_BYTES = tarstream.MAX_HEADER_BYTES
MAX_BUNDLE_ENTRIES = tarstream.MAX_ENTRIES
#: What one entry can add to a header at most: a 1024-byte key, each byte escaped (``\u00XX``),
#: and its metadata.
_MAX_ENTRY_BYTES = 6 * 1024 + 256


def bundle_key(root_name: str) -> str:
    return f"{BUNDLE_DIR}/{root_name}"


@dataclass(frozen=True)
class Change(tarstream.HeaderEntry):
    """One file of a batch: written (``meta``, and its bytes in ``data``, held or as a
    :class:`~sidecar.localfs.FileSource` streamed from the disk) or deleted (``meta`` None). A
    bundle's header gives written changes without their bytes (``data`` None)."""

    key: str
    data: bytes | FileSource | None
    meta: ObjectMeta | None  # None: deleted


# -- the bundle format ------------------------------------------------------------------------
#
# Version 2 (written): a POSIX tar archive (pax headers where a name needs them). Its first member,
# MANIFEST_NAME, is the JSON header {"version": 2, "root", "entries"}; then one member per written
# entry, in the header's order, named by its key, holding its bytes; then the end-of-archive
# blocks. Deletions are in the header only. Version 1 (read only; earlier releases): the JSON
# header {"version": 1, ...} on one line, then the written entries' bytes back to back.
# Both are written and read as streams, a chunk at a time: no file is held whole.


def _entry(c: Change) -> dict:
    if c.meta is None:
        return {"key": c.key, "deleted": True}
    return {"key": c.key, "size": c.meta.size, "sha256": c.meta.sha256, "mtime_ns": c.meta.mtime_ns,
            "mode": c.meta.mode}


def _header(root_name: str, changes: list[Change]) -> bytes:
    return json.dumps({"version": 2, "root": root_name, "entries": [_entry(c) for c in changes]},
                      separators=(",", ":")).encode()


def bundle_parts(root_name: str, changes: list[Change]) -> list[list[Change]]:
    """``changes`` in order, cut into consecutive parts whose bundles stay within the reader's
    limits (:data:`MAX_BUNDLE_ENTRIES`, :data:`MAX_HEADER_BYTES`): one part, unless the batch is
    larger than any bundle may be."""
    fixed = len(_header(root_name, []))
    if len(changes) <= MAX_BUNDLE_ENTRIES and fixed + len(changes) * _MAX_ENTRY_BYTES <= MAX_HEADER_BYTES:
        return [changes]
    parts: list[list[Change]] = [[]]
    size = fixed
    for c in changes:
        n = len(json.dumps(_entry(c), separators=(",", ":"))) + 1
        if parts[-1] and (len(parts[-1]) == MAX_BUNDLE_ENTRIES or size + n > MAX_HEADER_BYTES):
            parts.append([])
            size = fixed
        parts[-1].append(c)
        size += n
    return parts


def _members(changes: list[Change]) -> Iterator[Member]:
    for c in changes:
        if c.meta is None:
            continue
        assert c.data is not None, f"{c.key}: a written change without its bytes"
        yield Member(c.key, c.meta.size, c.meta.mode, c.meta.mtime_ns, c.data)


def bundle_chunks(root_name: str, changes: list[Change]) -> Iterator[bytes]:
    """The bundle of ``changes`` (every written one with its ``data``), in chunks of at most
    CHUNK_BYTES (small pieces joined). Blocking: a streamed file is read here, and raises
    (:class:`Unstable`) after its last chunk when it is no longer the version its metadata was
    hashed from."""
    return tar_chunks(MANIFEST_NAME, _header(root_name, changes), _members(changes))


def encode_bundle(root_name: str, changes: list[Change]) -> bytes:
    return b"".join(bundle_chunks(root_name, changes))


class BundleSource(TarSource):
    """A bundle to store as a stream (:class:`~sidecar.store.base.Source`): made by :meth:`measure`,
    which reads it once for its size and digests; every read after that yields the same bytes or
    raises :class:`Unstable` (a file changed), and the store then leaves the bundle as it was."""

    def __init__(self, root_name: str, changes: list[Change], size: int, sha256: str, md5: bytes) -> None:
        super().__init__(lambda: bundle_chunks(root_name, changes), size, sha256, md5)
        self.root_name, self.changes = root_name, changes

    @classmethod
    def measure(cls, root_name: str, changes: list[Change]) -> "BundleSource":
        """Blocking (reads the streamed files once)."""
        return cls(root_name, changes, *TarSource.digests(lambda: bundle_chunks(root_name, changes)))


class BundleError(ValueError):
    pass


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_header(raw: bytes, version: int) -> tuple[str, list[Change]]:
    """The root and changes (written ones without their bytes) of a bundle's JSON header."""
    try:
        header = load_header(raw, MAX_BUNDLE_ENTRIES, "bundle", BundleError)
        if not isinstance(header, dict):
            raise BundleError("unreadable bundle: the header is not an object")
        if header.get("version") != version:
            raise BundleError(f"unknown bundle version {header.get('version')!r}")
        root, entries = header["root"], header["entries"]
        if not isinstance(root, str) or not isinstance(entries, list):
            raise BundleError("unreadable bundle: malformed header")
        changes = []
        for e in entries:
            if not isinstance(e, dict) or not isinstance(e.get("key"), str):
                raise BundleError("unreadable bundle: malformed entry")
            if e.get("deleted"):
                changes.append(Change(e["key"], None, None))
                continue
            size = e["size"]
            if not _is_int(size) or size < 0:
                raise BundleError(f"unreadable bundle: entry {e['key']!r} has a bad size")
            if not (_is_int(e["mtime_ns"]) and _is_int(e["mode"]) and isinstance(e["sha256"], str)):
                raise BundleError(f"unreadable bundle: entry {e['key']!r} is malformed")
            changes.append(Change(e["key"], None, ObjectMeta(size, e["sha256"], e["mtime_ns"], e["mode"])))
        return root, changes
    except BundleError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise BundleError(f"unreadable bundle: {e}") from None


class BundleReader:
    """Reads a bundle (either version) from its chunks, as they arrive: :meth:`header` first, then
    :meth:`files` gives each written change's bytes, a chunk at a time, in the header's order,
    checked against its sha256 after the last. Anything malformed, cut short, or not matching is a
    :class:`BundleError` (a bundle is read from the store, so it is checked, never trusted)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._tar = TarReader(chunks, "bundle", BundleError)
        self.version = 0
        self.root = ""
        self.changes: list[Change] = []

    async def header(self) -> tuple[str, list[Change]]:
        t = self._tar
        if not await t.fill():
            raise BundleError("unreadable bundle: empty")
        if t.buffered.startswith(b"{"):
            self.version = 1
            while b"\n" not in t.buffered:
                if len(t.buffered) > MAX_HEADER_BYTES or not await t.fill():
                    raise BundleError("unreadable bundle: no header")
            raw = t.take(t.buffered.index(b"\n") + 1)[:-1]
        else:
            self.version = 2
            raw = await t.manifest(MANIFEST_NAME, MAX_HEADER_BYTES)
        self.root, self.changes = _parse_header(raw, self.version)
        return self.root, self.changes

    async def files(self) -> AsyncIterator[tuple[Change, AsyncIterator[bytes]]]:
        """Each written change with its bytes; read them to the end before the next. Ends after
        checking the bundle ends where its header says."""
        t = self._tar
        for c in self.changes:
            if c.meta is None:
                continue
            mismatch = f"bundle entry {c.key!r} does not match its sha256"
            if self.version == 2:
                body = t.body(c.key, c.meta.size, c.meta.sha256, mismatch)
            else:
                body = t.raw_body(c.meta.size, c.meta.sha256, mismatch)
            yield c, body
            await drain(body)
        if self.version == 2:
            await t.end()
        elif t.buffered or await t.fill():
            raise BundleError("unreadable bundle: bytes beyond its entries")


_T = TypeVar("_T")


def _run_now(coro: Coroutine[object, object, _T]) -> _T:
    """The result of a coroutine that never waits (a reader over bytes in hand)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("the coroutine waited")


async def _one(blob: bytes) -> AsyncIterator[bytes]:
    if blob:
        yield blob


async def read_all(reader: BundleReader) -> tuple[str, list[Change]]:
    """Every change of the bundle with its bytes held: for small bundles and tests only."""
    root, _ = await reader.header()
    got: dict[str, bytes] = {}
    async for c, body in reader.files():
        got[c.key] = b"".join([chunk async for chunk in body])
    return root, [c if c.meta is None else replace(c, data=got[c.key]) for c in reader.changes]


def decode_bundle(blob: bytes) -> tuple[str, list[Change]]:
    """The root and changes (with their bytes) a bundle of either version holds;
    :class:`BundleError` for anything else."""
    return _run_now(read_all(BundleReader(_one(blob))))


async def open_bundle(store: Store, root_name: str) -> tuple[BundleReader, AsyncIterator[bytes], ObjectInfo] | None:
    """The root's outstanding bundle, its header read (:meth:`BundleReader.header`), its stream
    (to close once done with) and the bundle object's info (its ``version`` orders it against the
    per-file objects); None when there is none. A bundle whose header names another root is a
    :class:`BundleError`."""
    try:
        stream = await store.get_stream(bundle_key(root_name))
    except NotFound:
        return None
    reader = BundleReader(stream.chunks)
    try:
        await reader.header()
        if reader.root != root_name:
            raise BundleError(f"unreadable bundle: it is stored as {root_name!r}'s but names the root {reader.root!r}")
    except BaseException:
        await stream.aclose()
        raise
    return reader, stream.chunks, stream.info


#: The restore's name for :func:`~sidecar.store.base.close_chunks` (a bundle's stream is closed
#: once its files are placed).


class Committer:
    """Commits batches of snapshot roots by the protocol above, against ``known`` (what the store is
    known to hold, kept current here). Its writes go through ``writer`` (a proof of ownership right
    before each, its version; :class:`~sidecar.fence.Fenced` once a newer sidecar owns the
    namespace), which it never bypasses."""

    def __init__(self, writer: Writer, roots: list[Root], ignore: IgnoreRules, known: StoreState, *,
                 max_file_size: int, totals: Totals, intact: Callable[[Root], bool] = lambda root: True,
                 on_skip: Callable[[str, Root, list[str], str, str], None] = lambda *a: None) -> None:
        self.writer = writer
        #: told of a file a commit leaves out (key, root, parts, "too_large" or "unreadable", why)
        self.on_skip = on_skip
        #: whether a root is the directory being mirrored: a commit deletes nothing while it is not
        self.intact = intact
        self.roots_by_name = {r.name: r for r in roots}
        self.ignore = ignore
        self.known = known
        self.max_file_size = max_file_size
        self.totals = totals
        #: per root: a commit's bundle put..delete and the start-up cleanup's delete never interleave
        self._locks: dict[str, anyio.Lock] = {}

    def _lock(self, root_name: str) -> anyio.Lock:
        return self._locks.setdefault(root_name, anyio.Lock())

    async def commit(self, root: Root, keys: list[str]) -> bool:
        """Commit ``keys`` of ``root`` as one consistent state; False when the disk moved."""

        skipped: list[tuple[str, list[str], str, str]] = []

        def snapshot() -> list[Change] | None:
            before, _ = scan_root(root, self.ignore)
            changes: list[Change] = []
            held = 0
            for key in sorted(keys):
                if key in before:
                    _, parts = split_key(key, self.roots_by_name)
                    try:
                        data: bytes | FileSource
                        if held + before[key].size <= HELD_MAX:
                            data, meta = read_stable(root, parts, self.max_file_size)
                            held += len(data)
                        else:  # hashed now, streamed from the disk when stored (checked to be this version)
                            data, meta = hash_stable(root, parts, self.max_file_size)
                    except (Vanished, Unstable):
                        return None
                    except TooLarge as e:  # left out, as a per-file upload skips it: its stored version stays
                        skipped.append((key, parts, "too_large", str(e)))
                        continue
                    except OSError as e:  # unreadable: likewise, never blocking the root's other files
                        skipped.append((key, parts, "unreadable", e.strerror or type(e).__name__))
                        continue
                    changes.append(Change(key, data, meta))
                elif key in self.known and absent(root, key.split("/", 1)[1]):
                    changes.append(Change(key, None, None))  # gone for sure: not merely unreadable
            after, _ = scan_root(root, self.ignore)
            if after != before:
                return None
            if not self.intact(root):  # removed or replaced as a whole: not the host's deletes
                changes = [c for c in changes if c.meta is not None]
            return changes

        changes = await anyio.to_thread.run_sync(snapshot)
        for key, where, reason, why in skipped:
            self.on_skip(key, root, where, reason, why)
        if changes is None:
            return False
        changes = [c for c in changes if c.meta is None or not (
            (info := self.known.get(c.key)) is not None and info.same_as(c.written))]
        parts = bundle_parts(root.name, changes)
        if len(parts) > 1:
            log.warning("snapshot_batch_split", root=root.name, changes=len(changes), parts=len(parts),
                        detail=f"more changes than one bundle may hold ({MAX_BUNDLE_ENTRIES} entries, a "
                               f"{MAX_HEADER_BYTES}-byte header): committed in parts, each crash-consistent alone")
        async with self._lock(root.name):
            try:
                for part in parts:
                    await self._apply(root, part)
            except (Unstable, Vanished):
                # A streamed file changed after the snapshot: nothing of it was stored. A bundle
                # already stored stays (restore lays it over a half-applied batch); the next
                # commit replaces it with the disk's new state.
                return False
        log.debug("snapshot_committed", root=root.name, changes=len(changes))
        return True

    async def _apply(self, root: Root, changes: list[Change]) -> None:
        # Every write proves ownership in the writer (free within the fence's window): a large
        # commit can outlast one proof, and a newer owner's objects must never see our writes after it.
        if len(changes) > 1 or (changes and self.known.has_bundle(root.name)):
            blob: bytes | BundleSource
            if all(not isinstance(c.data, FileSource) for c in changes):
                blob = encode_bundle(root.name, changes)  # at most HELD_MAX of files: one request
                meta = ObjectMeta.of(blob, time.time_ns(), 0o600)
            else:  # streamed, never held: read once for its digests, then again for the store
                blob = await anyio.to_thread.run_sync(BundleSource.measure, root.name, changes)
                meta = ObjectMeta(blob.size, blob.sha256, time.time_ns(), 0o600)
            await self.writer.put(bundle_key(root.name), blob, meta)
            self.known.add_bundle(root.name)
        for c in changes:  # the bundle makes the batch atomic; order within it does not matter
            if c.meta is None:
                await self.writer.delete(c.key)
                self.known.deleted(c.key)
                self.totals.deleted()
            else:
                assert c.data is not None
                self.known.stored(c.key, await self.writer.put(c.key, c.data, c.meta, expected=self.known.get(c.key)))
                self.totals.uploaded(c.meta.size)
        if self.known.has_bundle(root.name):
            await self.writer.delete(bundle_key(root.name))
            self.known.discard_bundle(root.name)

    async def drop_stale_bundles(self, snapshot_roots: set[str], keep: set[str],
                                 pending_keys: Callable[[], set[str]]) -> None:
        """Delete the bundles that cut-short snapshot commits left for roots with nothing left to
        commit (no key in ``pending_keys()``: their disk already matches the per-file objects),
        except for roots in ``keep`` (whose disk is not the truth). A bundle of a configured root
        committed file by file is deleted whatever is pending: no commit of that root replaces it,
        and its restore already placed what of it was newer than the per-file objects. The listing
        waits for the claim and a predecessor's window (:meth:`Writer.ready`); each delete proves
        ownership itself, after the listing and the root's lock. Raises :class:`~sidecar.fence.Fenced`."""
        await self.writer.ready()
        per_file: set[str] = set()
        # Listed again now that the claim's wait is over: a predecessor fenced in the middle of
        # a commit may have left its bundle after our start-up listing, and from now on none of
        # its writes can land. Left in place, a later restore would lay it over our files.
        try:
            async for info in self.writer.list(BUNDLE_DIR + "/"):
                name = info.key[len(BUNDLE_DIR) + 1 :]
                if name in snapshot_roots:
                    self.known.add_bundle(name)
                elif name in self.roots_by_name:
                    per_file.add(name)
        except StoreError as e:
            log.warning("bundle_cleanup_failed", root="-", error=str(e))
        for name in sorted(per_file - keep):
            async with self._lock(name):
                try:
                    await self.writer.delete(bundle_key(name))
                    log.info("bundle_dropped", root=name, detail="left by a snapshot commit cut short; this root "
                                                                 "is committed file by file")
                except StoreError as e:
                    log.warning("bundle_cleanup_failed", root=name, error=str(e))
        for name in sorted(self.known.bundles() - keep):
            async with self._lock(name):
                # decided under the lock: a commit of this root may have replaced the bundle, or
                # have changes to commit, since the loop began
                if not self.known.has_bundle(name) or any(k.split("/", 1)[0] == name for k in pending_keys()):
                    continue
                try:
                    await self.writer.delete(bundle_key(name))
                    self.known.discard_bundle(name)
                except StoreError as e:
                    log.warning("bundle_cleanup_failed", root=name, error=str(e))


#: The tar helpers under their earlier names (tests build hostile bundles with them).
_member, _pad = member_header, pad
