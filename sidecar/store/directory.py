"""The directory store: a plain directory (local disk, a mounted Azure Files share, NFS, a PVC).

Layout under ``<base>/<prefix>/``::

    <key>                          the object's bytes, mode and mtime as recorded
    .sidecar-meta/<key>.json       {"size", "sha256", "mtime_ns", "mode", "version", "data_mtime_ns",
                                    "stored_ns"}
    .sidecar-meta/<dir>/.sidecar-long-<sha256 of name>.json
                                   the same, for a name too long to take the ".json" suffix
                                   (a file name may have 255 bytes; ".sidecar-*" names are never
                                   mirrored, so this cannot collide with a real key's record)
    .sidecar-meta/.sidecar-lock    flock'ed while one of the sidecar's own objects is replaced
    .sidecar-meta/.sidecar-lock-NN flock'ed while a key hashed to stripe NN is replaced or deleted

Each file is written to a temp file, fsynced, renamed over the target, and its directory fsynced.
A replacement first removes the old metadata record (durably), then renames the data, then writes
the new record; ``list`` trusts a record only while the data file's size and mtime still match what
it recorded (``data_mtime_ns``). A crash anywhere in between therefore leaves an object whose sha256
is unknown (``None``) rather than a wrong one, even when the new version has the old one's size and
mtime, and reconciliation rewrites it. The record's ``version`` orders writes (the supersede rule
of :meth:`~sidecar.store.base.Store.put`) and is trusted while the record is there, whatever the
data file's mtime says: a store copied without mtimes keeps its order. A record-less object has
version 0, except one of the sidecar's own objects, written with its stamp as the file's mtime.
An object's ``modified`` is ``stored_ns``: when the store wrote it, by the filesystem's clock (the
temp file's change time as the put finished it), which a later chmod, rename or copy of the file
does not change; a record-less object's is its data file's change time.

A put streams its bytes into the temp file with no lock held; only the version check, the renames
and the record are one critical section, under an ``flock`` of the key's lock file (one of
:data:`LOCK_STRIPES`, by a hash of the key; the sidecar's own objects share ``.sidecar-lock``), so
an older put that finishes last never replaces a newer one, in this process or another. Deletes
take the same lock (a delete of a key that is not there takes none, and makes no lock file).
The namespace's last delete removes its lock files (each under its lock, and only while no writer
holds it), then its records' directory and its own: a writer that waited on a lock file removed
meanwhile finds it is no longer the one linked there and takes the lock again, made anew.

The base (``SIDECAR_STORE``) may itself be reached through a symlink: a mount point often is, and
it is the operator's own setting. Below it nothing is followed: every directory (the prefix's
segments, roots, nested directories, the records' tree, the lock files' directory) is opened one
component at a time with ``O_NOFOLLOW``, relative to its parent's descriptor; missing ones are
made, but the base only by :meth:`open`. A symlink planted there is neither followed nor removed:
a put or delete that would pass through it (or replace it) fails with one line naming it and the
key, and so does a get through one on the data's way; a listing does not descend into one, and one
on the namespace's own path fails every operation. Records and data files are read only when they
are regular files of bounded size reached so (a FIFO or a link to ``/dev/zero`` is refused); a
record that cannot be read leaves its object unverified.
A store holds a key or a directory of keys at one path, never both: a put replaces a stale object
standing where its directory goes (``a`` before ``a/b``), or the stale objects below a directory
standing where it goes. A writer's first put removes the temp files a crash left in its namespace:
a temp file is ``flock``'ed by its writer while it lives, so one that no writer holds and that is
older than :data:`~sidecar.store.dirfs.TEMP_GRACE_NS` by the store's clock is a dead writer's.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
import time
from contextlib import suppress
from itertools import islice
from typing import AsyncIterator, Callable, Generator, Iterator, Mapping, TypeVar

import anyio
import anyio.to_thread

from sidecar import log
from sidecar.paths import UnsafeKey, validate_relpath
from sidecar.store.base import (
    CHUNK_BYTES,
    NotFound,
    ObjectInfo,
    ObjectMeta,
    Source,
    StoreError,
    StoreFull,
    Stream,
    TransientStoreError,
    supersedes,
)
from sidecar.store.dirfs import (
    _READ_FLAGS,
    LIST_BATCH,
    MAX_STAMP_MTIME,
    META_DIR,
    OWN_PREFIX,
    TMP_PREFIX,
    _bounded,
    _child_dir,
    _clock_at,
    _fill,
    _fsync_dir,
    _identity,
    _key_order,
    _Link,
    _lstat_at,
    _meta_name,
    _meta_path,
    _nearest_dir,
    _read_record_at,
    _remove_durably,
    _temp_in,
    _unlink_durably,
    _unlink_quietly,
    _write_atomic,
)
from sidecar.store.dirlayout import Layout
from sidecar.store.dirlocation import DirectoryLocation, parse_url  # noqa: F401 (the registry's entry point)

T = TypeVar("T")

_CLOCK_TOLD = log.Once(limit=16)  # stores whose clock fell back to this machine's, said once each

class DirectoryStore(Layout):
    """``create=False`` (a read-only use such as ``status``): :meth:`open` makes no directory,
    and a store that does not exist yet lists as empty; ``writes=False`` (default: ``create``): nothing
    is written, not even the clock probe of :meth:`now` (a command that only reads)."""

    #: Keys are paths: ``a`` and ``a/x`` cannot both be stored, and the walk comes in no order.
    flat_namespace = False
    #: Set by :meth:`now` once it falls back to this machine's clock.
    clock_is_local = False

    def __init__(self, base: str, prefix: str = "", create: bool = True, writes: bool | None = None) -> None:
        self.create = create
        self.writes = create if writes is None else writes
        self.base = os.path.abspath(base)
        self.prefix = prefix.strip("/")
        self.top = os.path.join(self.base, self.prefix) if self.prefix else self.base
        self._prefix_parts = self.prefix.split("/") if self.prefix else []
        self._bad_prefix = ""
        if self.prefix:
            try:
                validate_relpath(self.prefix)
            except UnsafeKey as e:
                self._bad_prefix = str(e)
        self.description = f"file://{self.top}"
        self._limiter = anyio.CapacityLimiter(32)
        self._temps_cleaned = False
        self._temps_lock = threading.Lock()  # a writer's first puts run at once: one cleans, all wait
        self._links_told: set[str] = set()  # symlinks a listing skipped, named once each
        #: the store directory opened (its inode, :func:`_identity`): every later request checks it
        #: is still that one (None: not there when opened)
        self._base_id: int | None = None

    # -- helpers ---------------------------------------------------------------------------
    def _parts(self, key: str) -> list[str]:
        try:
            parts = validate_relpath(key)
        except UnsafeKey as e:
            raise StoreError(f"refusing unsafe key: {e}") from None
        if parts[0] in (META_DIR,) or any(p.startswith(TMP_PREFIX) for p in parts):
            raise StoreError(f"refusing reserved key {key!r}")
        return parts

    def _paths(self, key: str) -> tuple[str, str]:
        """The data file's and the record's absolute paths, as :func:`_write_atomic` and
        :func:`_remove_durably` take them (with :attr:`base` as their ``top``)."""
        parts = self._parts(key)
        return os.path.join(self.top, *parts), _meta_path(self.top, "/".join(parts))

    def _refused(self, e: _Link, key: str | None) -> StoreError:
        on_the_way = f" (on the way to {key!r})" if key else ""
        return StoreError(f"directory store {self.base}: refusing to follow the symlink {e.where!r} inside the "
                          f"store{on_the_way}; remove it")

    def _same_base(self) -> None:
        """Raise :class:`TransientStoreError` when the store's directory is not the one opened (a
        volume unmounted, its empty mount point in its place): writing there would make a second
        store at the same path, and what is read there is not this store."""
        if self._base_id is not None and _identity(self.base) != self._base_id:
            raise TransientStoreError(f"directory store {self.base} is not the directory it was when opened (a volume "
                                      "unmounted or replaced?): nothing is read or written there until it is back")

    async def _run(self, fn: Callable[..., T], *args: object, key: str | None = None) -> T:
        def checked() -> T:
            self._same_base()
            return fn(*args)

        try:
            return await anyio.to_thread.run_sync(checked, limiter=self._limiter)
        except (NotFound, StoreError):
            raise
        except _Link as e:
            raise self._refused(e, key) from None
        except OSError as e:
            raise self._error(e) from None

    def _error(self, e: OSError) -> StoreError:
        what = e.strerror or type(e).__name__
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreFull(f"directory store {self.top} is full ({what}); retrying until there is room")
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return StoreError(
                f"directory store {self.top}: {what}; check the volume is mounted writable "
                "for this user"
            )
        return StoreError(f"directory store {self.top}: {what} ({e.filename or ''})")

    # -- interface -------------------------------------------------------------------------
    async def open(self) -> None:
        def check() -> None:
            if not self.create:
                try:
                    fd = self._ns()
                except FileNotFoundError:
                    return  # not made yet: lists as empty (a path through a file or an unsearchable
                    # directory raises instead: what cannot be read is never taken for empty)
                try:
                    if not os.access(".", os.R_OK | os.X_OK, dir_fd=fd):
                        raise PermissionError(errno.EACCES, "not readable", self.top)
                finally:
                    os.close(fd)
                return
            os.makedirs(self.base, exist_ok=True)
            fd = self._ns(create=True)
            try:
                if not os.access(".", os.W_OK | os.X_OK, dir_fd=fd):
                    raise PermissionError(errno.EACCES, "not writable", self.top)
            finally:
                os.close(fd)

        await self._run(check, key=self.prefix)
        self._base_id = _identity(self.base)  # (None: not made, read-only: nothing to compare)

    async def put(self, key: str, data: bytes | Source, meta: ObjectMeta, if_version: int | None = None, *,
                  expected: ObjectInfo | None = None) -> ObjectInfo:
        # ``expected`` is not needed: the key's lock makes the check and the write one step
        parts = self._parts(key)
        _data_path, meta_path = self._paths(key)

        def write() -> ObjectInfo:
            if not self._temps_cleaned:
                with self._temps_lock:
                    if not self._temps_cleaned:
                        self._clean_temps()
            self._clear_way(parts)
            # The bytes go to a temp file beside the target with no lock held.
            dfd, tmp, fd = _temp_in(self.base, self._prefix_parts + parts[:-1])
            renamed = False
            try:
                written = _fill(fd, data, meta.mode, meta.mtime_ns)
                with self._locked(key):
                    renamed, info = self._replace(key, parts, dfd, tmp, written, meta, if_version, meta_path)
                return info
            finally:
                if not renamed:  # superseded, or failed: nothing written
                    _unlink_quietly(dfd, tmp)
                os.close(fd)  # (the temp's lock: see _new_temp)
                os.close(dfd)

        return await self._run(write, key=key)

    def _replace(self, key: str, parts: list[str], dfd: int, tmp: str, written: os.stat_result, meta: ObjectMeta,
                 if_version: int | None, meta_path: str) -> tuple[bool, ObjectInfo]:
        """The critical section of a put (under the key's lock): the version check, then the
        old record's removal, the rename of the temp file ``tmp`` (in ``dfd``) over the key, and
        the new record. Whether the temp was renamed, and the stored object's info."""
        name = parts[-1]
        st = _lstat_at(dfd, name)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise _Link(self._where(parts))
        if st is None or not stat.S_ISREG(st.st_mode):
            if if_version not in (None, 0):
                return False, ObjectInfo(key, 0, None, 0, 0)  # gone since it was read: nothing written
        else:
            # A stale upload never replaces a newer version.
            current = self._info(key, st, self._record(parts))
            if supersedes(current, meta.version) or (if_version is not None and current.version != if_version):
                return False, current
        # the old record must not outlive its bytes (see the module's docstring)
        _remove_durably(meta_path, self.base)
        try:
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except IsADirectoryError:
            raise StoreError(f"directory store {self.top}: {key!r} became a directory while it was written") from None
        _fsync_dir(dfd)
        record = {
            "size": meta.size,
            "sha256": meta.sha256,
            "mtime_ns": meta.mtime_ns,
            "mode": meta.mode,
            "version": meta.version,
            "data_mtime_ns": written.st_mtime_ns,
            "stored_ns": written.st_ctime_ns,
        }
        _write_atomic(meta_path, json.dumps(record).encode(), top=self.base)
        return True, ObjectInfo(key, meta.size, meta.sha256, meta.mtime_ns, meta.mode, str(written.st_mtime_ns),
                                meta.version, written.st_ctime_ns / 1e9)

    def _record(self, parts: list[str]) -> dict | None:
        """The key ``parts``' record, or None when there is none that can be read (a symlink on
        its way is never followed: the object is then unverified)."""
        try:
            rfd = self._dir([META_DIR, *parts[:-1]])
        except (OSError, _Link):
            return None
        try:
            return _read_record_at(rfd, _meta_name(parts[-1]))
        finally:
            os.close(rfd)

    def _info(self, key: str, st: os.stat_result, rec: dict | None) -> ObjectInfo:
        own = key.startswith(OWN_PREFIX)
        # the store's clock: when the put wrote it (see the module's docstring); a record-less
        # object's inode change time, where an own object's mtime is a stamp
        modified = st.st_ctime_ns / 1e9
        # a stamp is never a wall-clock time (see fence.next_stamp): a copied file's mtime is not one
        version = st.st_mtime_ns if own and 0 <= st.st_mtime_ns < MAX_STAMP_MTIME else 0
        try:
            if rec is None:
                raise KeyError("no record")
            if not isinstance(rec["sha256"], str):
                raise TypeError("no sha256")  # a record that vouches for nothing: unverified
            version = _bounded(rec.get("version", 0 if not own else rec.get("mtime_ns", 0)))
            with suppress(ValueError, TypeError, OverflowError):  # (a record of an older release has none)
                modified = _bounded(rec.get("stored_ns", 0)) / 1e9 or modified
            # A record is removed before its data is replaced, so one that is there describes the
            # last complete put: when the data file no longer matches it (copied without mtimes,
            # or changed by something else) its sha256 is still what the bytes must be, and a
            # restore checks them against it.
            return ObjectInfo(
                key, st.st_size, str(rec["sha256"]), _bounded(rec["mtime_ns"]), int(rec["mode"]) & 0o7777,
                str(st.st_mtime_ns), version, modified,
            )
        except (ValueError, KeyError, TypeError, OverflowError):
            pass
        return ObjectInfo(key, st.st_size, None, st.st_mtime_ns, st.st_mode & 0o7777, str(st.st_mtime_ns), version,
                          modified)

    async def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        def read() -> tuple[bytes, ObjectInfo]:
            fd, info = self._open_object(key)
            with os.fdopen(fd, "rb") as f:
                return f.read(), info

        return await self._run(read, key=key)

    async def get_stream(self, key: str, read_ahead: int = 0) -> Stream:
        fd, info = await self._run(self._open_object, key, key=key)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while chunk := await self._run(os.read, fd, CHUNK_BYTES):
                    yield chunk
            finally:
                os.close(fd)

        return Stream(info, chunks())

    def _open_object(self, key: str) -> tuple[int, ObjectInfo]:
        """An open descriptor of ``key``'s data file and its info (never through a symlink)."""
        parts = self._parts(key)
        try:
            dfd = self._dir(parts[:-1])
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(key) from None
        try:
            try:
                fd = os.open(parts[-1], _READ_FLAGS, dir_fd=dfd)
            except (FileNotFoundError, NotADirectoryError):
                raise NotFound(key) from None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise _Link(self._where(parts)) from None
                raise
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StoreError(f"directory store {self.top}: {key!r} is not a regular file")
            return fd, self._info(key, st, self._record(parts))
        except BaseException:
            os.close(fd)
            raise

    def _walk(self, prefix: str) -> Generator[ObjectInfo, None, None]:
        try:
            fd = self._ns()
        except FileNotFoundError:
            return
        try:
            try:
                rfd: int | None = _child_dir(fd, META_DIR, self._where([META_DIR]))
            except (OSError, _Link):
                rfd = None  # no records (or none that can be read): every object unverified
            try:
                yield from self._walk_dir(fd, rfd, [], prefix)
            finally:
                if rfd is not None:
                    os.close(rfd)
        finally:
            os.close(fd)

    def _walk_dir(self, dfd: int, rfd: int | None, parts: list[str], prefix: str) -> Iterator[ObjectInfo]:
        """The objects below the directory ``dfd`` (key path ``parts``; ``rfd``: its records'
        directory, or None), depth first in key order (a directory's entries sorted as the keys
        below them sort: ``a.txt`` before ``a/b``): it holds one descriptor per level. A symlink is
        neither listed nor descended into: it is named in one warning (the objects below it are
        unseen, which never counts as deleted)."""
        for entry in sorted(os.scandir(dfd), key=_key_order):
            if entry.name.startswith(TMP_PREFIX) or (not parts and entry.name == META_DIR):
                continue
            sub = parts + [entry.name]
            rel = "/".join(sub)
            try:
                if entry.is_dir(follow_symlinks=False):
                    if not (prefix.startswith(rel + "/") or rel.startswith(prefix)):
                        continue
                    try:
                        cfd = _child_dir(dfd, entry.name, self._where(sub))
                    except _Link:
                        self._link_skipped(sub)
                        continue
                    except (FileNotFoundError, NotADirectoryError):
                        continue  # gone, or replaced meanwhile
                    crfd: int | None = None
                    if rfd is not None:
                        try:
                            crfd = _child_dir(rfd, entry.name, self._where([META_DIR, *sub]))
                        except (OSError, _Link):
                            crfd = None
                    try:
                        yield from self._walk_dir(cfd, crfd, sub, prefix)
                    finally:
                        os.close(cfd)
                        if crfd is not None:
                            os.close(crfd)
                elif entry.is_file(follow_symlinks=False) and rel.startswith(prefix):
                    st = entry.stat(follow_symlinks=False)
                    yield self._info(rel, st, _read_record_at(rfd, _meta_name(entry.name)))
                elif entry.is_symlink() and (prefix.startswith(rel + "/") or rel.startswith(prefix)):
                    self._link_skipped(sub)
            except FileNotFoundError:
                continue

    def _link_skipped(self, parts: list[str]) -> None:
        where = self._where(parts)
        if where not in self._links_told:
            self._links_told.add(where)
            log.warning("store_link_skipped", path=where,
                        detail="a symlink inside the directory store is never followed: what lies behind it is not "
                               "listed nor restored (and never taken for deleted); replace it with a real directory")

    async def delete(self, key: str) -> None:
        await self._run(self._remove, key, self._parts(key), None, key=key)

    async def delete_if(self, key: str, version: int) -> bool:
        return await self._run(self._remove, key, self._parts(key), version, key=key)

    async def exists(self) -> bool:
        """Whether the store's directory (``SIDECAR_STORE``, not the prefix) is there."""
        return await self._run(os.path.isdir, self.base)

    async def now(self) -> float:
        why = "this command only reads the store, so it makes no clock probe there"
        if self.writes:
            try:
                return await self._run(self._read_clock)
            except StoreError as e:  # a read-only or missing store: no temp file can be made there
                why = f"the store's clock cannot be read (no file can be made there: {e})"
        self.clock_is_local = True  # prune refuses to judge ages by it (sidecar.ops.prune)
        if _CLOCK_TOLD.first(self.top):  # one warning line per store
            log.warning("store_clock_local", store=self.top, detail=f"{why}: this machine's clock is used instead")
        return time.time()

    def _read_clock(self) -> float:  # in the namespace's directory, or where it would be made (not yet)
        try:
            return _clock_at(self._ns(), close=True)
        except FileNotFoundError:
            return _clock_at(_nearest_dir(self.base, self._prefix_parts), close=True)

    def _remove(self, key: str, parts: list[str], version: int | None) -> bool:
        """:meth:`delete` (``version`` None) or :meth:`delete_if`; whether something was removed."""
        try:
            os.close(self._ns())
        except FileNotFoundError:
            return False  # nothing stored here yet (and nothing made for a delete)
        if not self._present(parts):
            return False  # (no lock file made for it either)
        with self._locked(key):
            if version is not None:
                try:
                    fd, info = self._open_object(key)
                except NotFound:
                    return False
                os.close(fd)
                if info.version != version:
                    return False
            # both ways are checked before either file is removed: a refusal changes nothing
            found: list[tuple[int, str]] = []
            try:
                for target, data in ((parts, True), ([META_DIR, *parts[:-1], _meta_name(parts[-1])], False)):
                    if (where := self._target(target, data)) is not None:
                        found.append(where)
                removed = [_unlink_durably(*where) for where in found]
            finally:
                for dfd, _name in found:
                    os.close(dfd)
        if not any(removed):
            return False
        # Prune directories left empty, up to (not including) the namespace and its records; the
        # namespace's last object takes its lock files and directories with it.
        emptied = self._prune(parts[:-1])
        self._prune([META_DIR, *parts[:-1]], keep=1)
        if emptied:
            self._drop_locks()
        return True

    def _present(self, parts: list[str]) -> bool:
        """Whether the key ``parts`` has a data file or a record (a delete of neither changes
        nothing: it takes no lock)."""
        for target, data in ((parts, True), ([META_DIR, *parts[:-1], _meta_name(parts[-1])], False)):
            if (where := self._target(target, data)) is not None:
                os.close(where[0])
                return True
        return False

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Walked in a worker thread LIST_BATCH entries at a time, each batch yielded as it is read:
        a restore starts downloading while the walk goes on (on NFS or Azure Files every entry
        costs a stat and a metadata read over the network)."""
        walker = self._walk(prefix)
        try:
            while batch := await self._run(lambda: list(islice(walker, LIST_BATCH)), key=prefix):
                for info in batch:
                    yield info
        finally:
            walker.close()  # closes the directories it holds open

    async def aclose(self) -> None:
        return None


# -- the registry's entry points (sidecar.store.registry) -----------------------------------------

def make(location: DirectoryLocation, prefix: str, *, create: bool, concurrency: int, env: Mapping[str, str],
         writes: bool | None = None) -> DirectoryStore:
    """The directory store at ``location`` with ``prefix`` below it (``concurrency``, ``env``: not needed)."""
    return DirectoryStore(location.path, prefix, create=create, writes=writes)
