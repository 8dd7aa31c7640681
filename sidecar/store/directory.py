"""The directory store: a plain directory (local disk, a mounted Azure Files share, NFS, a PVC).

Layout under ``<base>/<prefix>/``::

    <key>                          the object's bytes, mode and mtime as recorded
    .sidecar-meta/<key>.json       {"size", "sha256", "mtime_ns", "mode", "version", "data_mtime_ns"}
    .sidecar-meta/<dir>/.sidecar-long-<sha256 of name>.json
                                   the same, for a name too long to take the ".json" suffix
                                   (a file name may have 255 bytes; ".sidecar-*" names are never
                                   mirrored, so this cannot collide with a real key's record)

Each file is written to a temp file, fsynced, renamed over the target, and its directory fsynced.
A replacement first removes the old metadata record (durably), then writes the data, then the new
record; ``list`` trusts a record only while the data file's size and mtime still match what it
recorded (``data_mtime_ns``). A crash anywhere in between therefore leaves an object whose sha256
is unknown (``None``) rather than a wrong one, even when the new version has the old one's size and
mtime, and reconciliation rewrites it. The record's ``version`` orders writes (the supersede rule
of :meth:`~sidecar.store.base.Store.put`) and is trusted while the record is there, whatever the
data file's mtime says: a store copied without mtimes keeps its order. A record-less object has
version 0, except one of the sidecar's own objects, written with its stamp as the file's mtime.

Below the store's top nothing is followed: a symlink planted inside the store makes the write or
delete that would pass through it fail (one line naming it), and records and data files are read
only when they are regular files of bounded size (a FIFO or a link to ``/dev/zero`` is refused).
A store holds a key or a directory of keys at one path, never both: a put replaces a stale object
standing where its directory goes (``a`` before ``a/b``), or the stale objects below a directory
standing where it goes. A writer's first put removes the temp files a crash left behind.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
import threading
from itertools import islice
from typing import AsyncIterator, Iterator

import anyio
import anyio.to_thread

from sidecar.paths import UnsafeKey, validate_relpath
from sidecar.store.base import CHUNK_BYTES, OWN_NAMESPACE, NotFound, ObjectInfo, ObjectMeta, Source, StoreError, StoreFull

META_DIR = ".sidecar-meta"
TMP_PREFIX = ".sidecar-tmp-"
#: Entries read per worker-thread call while listing.
LIST_BATCH = 256
LONG_META_PREFIX = ".sidecar-long-"
NAME_MAX = 255  # bytes in one file name (ext4, xfs, tmpfs, NFS, SMB)
#: The sidecar's own objects (owner marker, bundles): written with their stamp as the mtime too.
OWN_PREFIX = OWN_NAMESPACE + "/"
#: File mtimes below this are stamps, not wall-clock times (2^52 ns is in 1970).
MAX_STAMP_MTIME = 2**52


def _bounded(value: object) -> int:
    """A non-negative integer of a record, or 0 (a record edited by hand)."""
    number = int(value)  # type: ignore[call-overload]
    return number if 0 <= number < 2**63 else 0


#: A metadata record is a small JSON object; anything larger is not one of ours.
MAX_RECORD_BYTES = 4096
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_regular(path: str) -> int:
    """An fd of ``path`` when it is a regular file (never a symlink, FIFO or device: opening
    those could block or read without end). FileNotFoundError when missing, OSError(EINVAL) when
    it is something else."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink
            raise OSError(errno.EINVAL, "a symlink, not a stored file", path) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd


def _read_record(path: str) -> dict:
    """A metadata record; ValueError when it is not a small JSON object, OSError when unreadable."""
    fd = _open_regular(path)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_RECORD_BYTES + 1)
    if len(raw) > MAX_RECORD_BYTES:
        raise ValueError("record too large")
    rec = json.loads(raw)
    if not isinstance(rec, dict):
        raise ValueError("record is not an object")
    return rec


def _meta_name(name: str) -> str:
    """The metadata record's file name for a data file called ``name``."""
    if len(name.encode("utf-8", "surrogateescape")) + len(".json") <= NAME_MAX:
        return name + ".json"
    return LONG_META_PREFIX + hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest() + ".json"


def _meta_path(top: str, rel: str) -> str:
    head, _, name = rel.rpartition("/")
    return os.path.join(top, META_DIR, *([head] if head else []), _meta_name(name))


RACE_ATTEMPTS = 10  # makedirs/open retries against concurrent pruning of empty directories


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_nearest_dir(path: str, top: str) -> None:
    """fsync ``path``, or, when a concurrent delete has pruned it already, its nearest existing
    ancestor (at most ``top``): the directory entry that changed last lives there."""
    while True:
        try:
            _fsync_dir(path)
            return
        except (FileNotFoundError, NotADirectoryError):
            if path == top or not path.startswith(top):
                raise
            path = os.path.dirname(path)


def _remove_durably(path: str, top: str) -> None:
    """Unlink ``path`` (if there) and fsync its directory (or, when a concurrent delete has pruned
    it, its nearest existing ancestor)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    _fsync_nearest_dir(os.path.dirname(path), top)


def _write_atomic(path: str, data: "bytes | Source", mode: int = 0o600, mtime_ns: int | None = None) -> os.stat_result:
    """Write ``path`` via temp + fsync + rename + dir fsync; returns the file's final status."""
    directory = os.path.dirname(path)
    for attempt in range(RACE_ATTEMPTS):
        tmp = os.path.join(directory, TMP_PREFIX + secrets.token_hex(6))
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except (FileNotFoundError, FileExistsError):
            # A concurrent delete pruned the empty directory (or a parent) between makedirs and
            # open, or between makedirs' mkdir and its own isdir check: make it again.
            if attempt == RACE_ATTEMPTS - 1:
                raise
            continue
        try:
            with os.fdopen(fd, "wb") as f:
                if isinstance(data, bytes):
                    f.write(data)
                else:  # streamed; raises after the last chunk if the source changed
                    for chunk in data.iter_sync():
                        f.write(chunk)
                f.flush()
                os.fchmod(f.fileno(), mode & 0o7777)
                if mtime_ns is not None:
                    os.utime(f.fileno(), ns=(mtime_ns, mtime_ns))
                os.fsync(f.fileno())
                final = os.fstat(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(directory)
        return final
    raise AssertionError("unreachable")


class DirectoryStore:
    """``create=False`` (a read-only use such as ``status``): :meth:`open` makes no directory,
    and a store that does not exist yet lists as empty."""

    def __init__(self, base: str, prefix: str = "", create: bool = True) -> None:
        self.create = create
        self.base = os.path.abspath(base)
        self.prefix = prefix.strip("/")
        self.top = os.path.join(self.base, self.prefix) if self.prefix else self.base
        self.description = f"file://{self.top}"
        self._limiter = anyio.CapacityLimiter(32)
        self._temps_cleaned = False
        self._temps_lock = threading.Lock()  # a writer's first puts run at once: one cleans, all wait

    # -- helpers ---------------------------------------------------------------------------
    def _paths(self, key: str) -> tuple[str, str]:
        try:
            parts = validate_relpath(key)
        except UnsafeKey as e:
            raise StoreError(f"refusing unsafe key: {e}") from None
        if parts[0] in (META_DIR,) or any(p.startswith(TMP_PREFIX) for p in parts):
            raise StoreError(f"refusing reserved key {key!r}")
        return os.path.join(self.top, *parts), _meta_path(self.top, "/".join(parts))

    def _clear_way(self, path: str, data: bool) -> None:
        """Make sure nothing below ``top`` on the way to ``path`` is a symlink (StoreError naming
        it), and, for a data path, that no stale object stands in it: a file where a directory
        goes, or a directory of objects where a file goes (removed with their records)."""
        rel = os.path.relpath(path, self.top).split(os.sep)
        here = self.top
        for i, part in enumerate(rel):
            here = os.path.join(here, part)
            try:
                st = os.lstat(here)
            except (FileNotFoundError, NotADirectoryError):
                return
            last = i == len(rel) - 1
            if stat.S_ISLNK(st.st_mode):
                raise StoreError(f"directory store {self.top}: refusing to follow the symlink "
                                 f"{'/'.join(rel[:i + 1])!r} inside the store; remove it")
            if not data:
                continue
            if not last and stat.S_ISREG(st.st_mode):  # an object "a" where "a/b" must go
                self._check_objects(here, ["/".join(rel[:i + 1])])
                _remove_durably(here, self.top)
                _remove_durably(_meta_path(self.top, "/".join(rel[:i + 1])), self.top)
                return
            if last and stat.S_ISDIR(st.st_mode):  # objects "a/..." where "a" must go
                below = []
                for dirpath, _dirs, files in os.walk(here):
                    below += [os.path.relpath(os.path.join(dirpath, f), self.top) for f in files]
                self._check_objects(here, below)
                shutil.rmtree(here)
                shutil.rmtree(os.path.join(self.top, META_DIR, *rel), ignore_errors=True)
                _fsync_dir(os.path.dirname(here))

    def _check_objects(self, where: str, keys: list[str]) -> None:
        """Only stored objects (with their records) may be replaced: anything else in the way is
        not ours to remove."""
        for key in keys:
            if not os.path.exists(_meta_path(self.top, key)):
                raise StoreError(f"directory store {self.top}: {os.path.relpath(where, self.top)!r} is in the way "
                                 "and is not a stored object (something else wrote it); remove it")

    def _clean_temps(self) -> None:
        """Remove the temp files that crashed writers left (once, before this writer's first put)."""
        for dirpath, dirnames, filenames in os.walk(self.top):  # os.walk follows no symlinks
            for name in filenames:
                if name.startswith(TMP_PREFIX):
                    try:
                        os.unlink(os.path.join(dirpath, name))
                    except OSError:
                        pass
        self._temps_cleaned = True

    async def _run(self, fn, *args):
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        except (NotFound, StoreError):
            raise
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
                    st = os.stat(self.top)
                except FileNotFoundError:
                    return  # not made yet: lists as empty (a path through a file or an unsearchable
                    # directory raises instead: what cannot be read is never taken for empty)
                if not stat.S_ISDIR(st.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory", self.top)
                if not os.access(self.top, os.R_OK | os.X_OK):
                    raise PermissionError(errno.EACCES, "not readable", self.top)
                return
            os.makedirs(self.top, exist_ok=True)
            if not os.access(self.top, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable", self.top)

        await self._run(check)

    async def put(self, key: str, data: bytes | Source, meta: ObjectMeta, if_version: int | None = None) -> ObjectInfo:
        data_path, meta_path = self._paths(key)

        def write() -> ObjectInfo:
            if not self._temps_cleaned:
                with self._temps_lock:
                    if not self._temps_cleaned:
                        self._clean_temps()
            self._clear_way(data_path, data=True)
            self._clear_way(meta_path, data=False)
            # A stale upload never replaces a newer version (mtime_ns is the version stamp).
            try:
                st = os.stat(data_path, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                if if_version not in (None, 0):
                    return ObjectInfo(key, 0, None, 0, 0)  # gone since it was read: nothing written
            else:
                current = self._info(key, data_path, meta_path, st)
                if current.version > meta.version or (if_version is not None and current.version != if_version):
                    return current
                # the old record must not outlive its bytes (see the module's docstring)
                _remove_durably(meta_path, self.top)
            written = _write_atomic(data_path, data, meta.mode, meta.mtime_ns)
            record = {
                "size": meta.size,
                "sha256": meta.sha256,
                "mtime_ns": meta.mtime_ns,
                "mode": meta.mode,
                "version": meta.version,
                "data_mtime_ns": written.st_mtime_ns,
            }
            _write_atomic(meta_path, json.dumps(record).encode())
            return ObjectInfo(key, meta.size, meta.sha256, meta.mtime_ns, meta.mode, str(written.st_mtime_ns),
                              meta.version)

        if key.startswith(OWN_PREFIX):  # the owner marker, bundles: see _locked
            return await self._run(lambda: self._locked(write))
        return await self._run(write)

    def _locked(self, fn):
        """``fn()`` under an exclusive ``flock`` on the store's lock file, so that two writers'
        check-then-replace of the same object never interleave: two sidecars claiming the owner
        marker at once would otherwise both pass the stamp check, and the lower stamp could land
        last. (Across hosts this holds where the shared filesystem honours flock, as NFS does.)"""
        lock_dir = os.path.join(self.top, META_DIR)
        os.makedirs(lock_dir, exist_ok=True)
        fd = os.open(os.path.join(lock_dir, ".sidecar-lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return fn()
        finally:
            os.close(fd)  # releases the lock

    def _info(self, key: str, data_path: str, meta_path: str, st: os.stat_result) -> ObjectInfo:
        own = key.startswith(OWN_PREFIX)
        # a stamp is never a wall-clock time (see fence.next_stamp): a copied file's mtime is not one
        version = st.st_mtime_ns if own and 0 <= st.st_mtime_ns < MAX_STAMP_MTIME else 0
        try:
            rec = _read_record(meta_path)
            if not isinstance(rec["sha256"], str):
                raise TypeError("no sha256")  # a record that vouches for nothing: unverified
            version = _bounded(rec.get("version", 0 if not own else rec.get("mtime_ns", 0)))
            # A record is removed before its data is replaced, so one that is there describes the
            # last complete put: when the data file no longer matches it (copied without mtimes,
            # or changed by something else) its sha256 is still what the bytes must be, and a
            # restore checks them against it.
            return ObjectInfo(
                key, st.st_size, str(rec["sha256"]), _bounded(rec["mtime_ns"]), int(rec["mode"]) & 0o7777,
                str(st.st_mtime_ns), version,
            )
        except (OSError, ValueError, KeyError, TypeError, OverflowError):
            pass
        return ObjectInfo(key, st.st_size, None, st.st_mtime_ns, st.st_mode & 0o7777, str(st.st_mtime_ns), version)

    async def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        def read() -> tuple[bytes, ObjectInfo]:
            fd, info = self._open_object(key)
            with os.fdopen(fd, "rb") as f:
                return f.read(), info

        return await self._run(read)

    async def get_stream(self, key: str) -> tuple[ObjectInfo, AsyncIterator[bytes]]:
        fd, info = await self._run(self._open_object, key)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while chunk := await self._run(os.read, fd, CHUNK_BYTES):
                    yield chunk
            finally:
                os.close(fd)

        return info, chunks()

    def _open_object(self, key: str) -> tuple[int, ObjectInfo]:
        """An open descriptor of ``key``'s data file and its info (never through a symlink)."""
        data_path, meta_path = self._paths(key)
        self._clear_way(data_path, data=False)
        try:
            fd = _open_regular(data_path)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(key) from None
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise StoreError(f"directory store {self.top}: {key!r} is {e.strerror}") from None
            raise
        try:
            return fd, self._info(key, data_path, meta_path, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Walked in a worker thread LIST_BATCH entries at a time, each batch yielded as it is read:
        a restore starts downloading while the walk goes on (on NFS or Azure Files every entry
        costs a stat and a metadata read over the network)."""
        walker = self._walk(prefix)
        while batch := await self._run(lambda: list(islice(walker, LIST_BATCH))):
            for info in batch:
                yield info

    def _walk(self, prefix: str) -> Iterator[ObjectInfo]:
        if not os.path.isdir(self.top):
            return
        stack = [("", self.top)]
        while stack:
            rel_dir, abs_dir = stack.pop()
            try:
                entries = list(os.scandir(abs_dir))
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.name.startswith(TMP_PREFIX) or (not rel_dir and entry.name == META_DIR):
                    continue
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                if entry.is_dir(follow_symlinks=False):
                    if prefix.startswith(rel + "/") or rel.startswith(prefix) or not prefix:
                        stack.append((rel, entry.path))
                elif entry.is_file(follow_symlinks=False) and rel.startswith(prefix):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    meta_path = _meta_path(self.top, rel)
                    yield self._info(rel, entry.path, meta_path, st)

    async def delete(self, key: str) -> None:
        data_path, meta_path = self._paths(key)

        def remove() -> None:
            self._clear_way(data_path, data=False)
            self._clear_way(meta_path, data=False)
            removed = False
            for p in (data_path, meta_path):
                try:
                    if p == data_path and not stat.S_ISREG(os.lstat(p).st_mode):
                        continue  # a directory of other keys stands there now: this object is gone
                    os.unlink(p)
                    removed = True
                except (FileNotFoundError, NotADirectoryError):
                    pass
            if not removed:
                return
            _fsync_nearest_dir(os.path.dirname(data_path), self.top)
            # Prune directories left empty, up to (not including) the store's top.
            for p in (data_path, meta_path):
                d = os.path.dirname(p)
                while d not in (self.top, os.path.join(self.top, META_DIR)) and d.startswith(self.top):
                    try:
                        os.rmdir(d)
                    except OSError:
                        break
                    d = os.path.dirname(d)

        await self._run(remove)

    async def aclose(self) -> None:
        return None
