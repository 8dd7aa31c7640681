"""Writing restored files with the sidecar's safety rules: never through a symlink, never outside
a root, atomically (temp file, rename) and checked against the stored hash; and the records at the
top of a root: the restore marker, the kept keys and the lineage. Blocking functions; callers run
them in worker threads. Reading and scanning local files is :mod:`sidecar.localfs`'s."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import secrets
import stat
from dataclasses import dataclass

from sidecar.localfs import MAX_MTIME_NS, UnsafeTarget, open_child_dir, open_dir_nofollow, open_root
from sidecar.paths import KEPT_FILE, LINEAGE_FILE, RESTORE_MARKER, RESTORE_TMP_PREFIX, Root


class OpenDirs:
    """The directories one restore writes into, each opened (and made) once, the way
    :func:`open_dir_nofollow` opens them: a 1,000-file restore otherwise spends 4,000 system
    calls re-walking the same few directories. Holds at most ``limit`` descriptors (least recently
    used closed first). Not thread-safe: use it from one thread."""

    def __init__(self, limit: int = 128) -> None:
        self.limit = limit
        self._fds: dict[tuple[str, tuple[str, ...]], int] = {}

    def get(self, root: Root, parts: list[str] | tuple[str, ...]) -> int:
        key = (root.path, tuple(parts))
        fd = self._fds.pop(key, None)
        if fd is None:
            fd = open_child_dir(self.get(root, parts[:-1]), parts[-1], root.path, True) if parts else open_root(root.path, True)
            while len(self._fds) >= self.limit:
                os.close(self._fds.pop(next(iter(self._fds))))
        self._fds[key] = fd  # most recently used last
        return fd

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])


class ChecksumMismatch(Exception):
    pass


class RestoreTemp:
    """One restored file being written: a temp file in the target directory (reached without
    following a symlink), hashed as written; :meth:`finish` checks it against the stored sha256,
    sets mode and mtime and renames it over the target; :meth:`abort` leaves nothing behind.
    Blocking; a large file is written a chunk at a time, so it is never held whole."""

    def __init__(self, root: Root, parts: list[str], dirs: OpenDirs | None = None, hashed: bool = True) -> None:
        """``hashed=False``: the caller has checked the bytes already (:meth:`finish` is then
        given no sha256)."""
        self.parts = parts
        self._own_dfd = dirs is None
        self.dfd = dirs.get(root, parts[:-1]) if dirs is not None else open_dir_nofollow(root.path, parts[:-1], create=True)
        self.tmp = RESTORE_TMP_PREFIX + secrets.token_hex(6)
        self.digest = hashlib.sha256() if hashed else None
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                              dir_fd=self.dfd)
        except BaseException:
            self._close_dir()
            raise

    def write(self, data: bytes) -> None:
        if self.digest is not None:
            self.digest.update(data)
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def finish(self, mtime_ns: int, mode: int, sha256: str | None) -> None:
        try:
            if sha256 is not None and (self.digest is None or self.digest.hexdigest() != sha256):
                raise ChecksumMismatch("/".join(self.parts))
            os.fchmod(self.fd, safe_mode(mode))
            if 0 <= mtime_ns < MAX_MTIME_NS:  # a stored value out of range: the file keeps the time of now
                os.utime(self.fd, ns=(mtime_ns, mtime_ns))
            os.close(self.fd)
            self.fd = -1
            # rename replaces a symlink itself, never what it points to, and refuses (EISDIR) to
            # replace a directory
            try:
                os.rename(self.tmp, self.parts[-1], src_dir_fd=self.dfd, dst_dir_fd=self.dfd)
            except IsADirectoryError:
                raise UnsafeTarget(f"{'/'.join(self.parts)} is a directory on disk") from None
        except BaseException:
            self.abort()
            raise
        self._close_dir()

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(OSError):
            os.unlink(self.tmp, dir_fd=self.dfd)
        self._close_dir()

    def _close_dir(self) -> None:
        if self._own_dfd and self.dfd >= 0:
            os.close(self.dfd)
        self.dfd = -1


def write_restored(root: Root, parts: list[str], data: bytes, mtime_ns: int, mode: int,
                   sha256: str | None = None, dirs: OpenDirs | None = None) -> None:
    """Place one restored file atomically: checked against ``sha256`` (when known), written to a
    temp file in the target directory, mode and mtime set, renamed over the target. Nothing is left
    behind on failure (a full disk included). ``dirs`` keeps the directories open between calls.
    ``sha256=None``: the bytes were checked already (an archive's reader checks each entry)."""
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise ChecksumMismatch("/".join(parts))
    temp = RestoreTemp(root, parts, dirs, hashed=False)
    try:
        temp.write(data)
    except BaseException:
        temp.abort()
        raise
    temp.finish(mtime_ns, mode, None)  # checked above, before anything was written


def safe_mode(mode: int) -> int:
    """Stored permission bits without world-write or set-id bits; 0600 when none were stored."""
    mode &= 0o777 & ~0o002
    return mode or 0o600


def syncfs(path: str) -> None:
    """Flush the filesystem holding ``path`` once (``syncfs(2)``; ``sync()`` where unavailable)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        os.sync()
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            os.sync()
    except (OSError, AttributeError):
        os.sync()
    finally:
        os.close(fd)


def mark_restoring(root: Root) -> None:
    """Put the restore marker at the top of ``root`` (created if missing) before any file lands."""
    dfd = open_root(root.path, create=True)
    try:
        fd = os.open(RESTORE_MARKER, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        os.close(fd)
        # Durable before any restored file can be: after a power cut, a root holding files but no
        # marker would be trusted as complete. Cheap: little is dirty this early.
        os.fsync(dfd)
    finally:
        os.close(dfd)


#: The kept-keys file is small: more keys than this are not recorded (the rest are still kept
#: for as long as this process runs).
MAX_KEPT = 10_000


def load_kept(root: Root) -> set[str]:
    """The keys :func:`save_kept` recorded in ``root`` (a bounded regular file read without
    following links); empty when there is none or it is not ours."""
    try:
        dfd = open_root(root.path, create=False)
    except OSError:
        return set()
    try:
        fd = os.open(KEPT_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return set()
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return set()
        raw = os.read(fd, 4 * 1024 * 1024)
    finally:
        os.close(fd)
    try:
        keys = json.loads(raw)
    except (ValueError, RecursionError):  # malformed, or nested past the parser's depth
        return set()
    if not isinstance(keys, list):
        return set()
    return {k for k in keys[:MAX_KEPT] if isinstance(k, str) and k.startswith(root.name + "/")}


def save_kept(root: Root, keys: set[str]) -> None:
    """Record ``keys`` (this root's) at the top of ``root``, atomically; none: the file goes."""
    mine = sorted(k for k in keys if k.startswith(root.name + "/"))[:MAX_KEPT]
    try:
        dfd = open_root(root.path, create=bool(mine))
    except OSError:
        return
    try:
        if not mine:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(KEPT_FILE, dir_fd=dfd)
            return
        tmp = RESTORE_TMP_PREFIX + secrets.token_hex(6)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            os.write(fd, json.dumps(mine).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, KEPT_FILE, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


@dataclass(frozen=True)
class Lineage:
    """Which store and namespace a root's files came from or went to: the store's description
    (secret-free, its prefix included), the namespace path, and the generation of the namespace's
    state the disk holds (the owner marker's; None in a record that carries none)."""

    store: str
    namespace: str
    generation: int | None = None


#: The lineage record is tiny; anything larger is not ours.
MAX_LINEAGE_BYTES = 64 * 1024


def read_lineage(root: Root) -> Lineage | None:
    """The lineage recorded at the top of ``root`` (a bounded regular file read without following
    links); None when there is none, it cannot be read, or it is not ours."""
    try:
        dfd = open_root(root.path, create=False)
    except OSError:
        return None
    try:
        fd = os.open(LINEAGE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, MAX_LINEAGE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        record = json.loads(raw) if len(raw) <= MAX_LINEAGE_BYTES else None
    except (ValueError, RecursionError):  # malformed, or nested past the parser's depth
        return None
    if not isinstance(record, dict) or not isinstance(record.get("store"), str) \
            or not isinstance(record.get("namespace"), str):
        return None
    generation = record.get("generation")
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        generation = None
    return Lineage(record["store"], record["namespace"], generation)


def write_lineage(root: Root, lineage: Lineage) -> None:
    """Record ``lineage`` at the top of ``root``, durably and atomically (temp file, fsync, rename,
    directory fsync): after a crash the root carries the old record or the new, whole. The root is
    never created: FileNotFoundError when it does not exist."""
    dfd = open_root(root.path, create=False)
    try:
        tmp = RESTORE_TMP_PREFIX + secrets.token_hex(6)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            try:
                record: dict[str, object] = {"store": lineage.store, "namespace": lineage.namespace}
                if lineage.generation is not None:
                    record["generation"] = lineage.generation
                os.write(fd, json.dumps(record).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, LINEAGE_FILE, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        os.fsync(dfd)
    finally:
        os.close(dfd)


def lineage_recorded(root: Root) -> bool:
    """Whether ``root`` carries a lineage record at all (a ``stat``: cheap enough for every
    reconcile; :func:`read_lineage` says whose it is)."""
    return os.path.lexists(os.path.join(root.path, LINEAGE_FILE))


def restore_cut_short(root: Root) -> bool:
    """True when a restore into ``root`` began and never finished (its marker is still there)."""
    return os.path.lexists(os.path.join(root.path, RESTORE_MARKER))


def clear_restoring(root: Root) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root.path, RESTORE_MARKER))


def remove_stale_restore_temps(root: Root) -> None:
    """Temp files a killed restore left behind."""
    for dirpath, _dirs, files in os.walk(root.path):
        for name in files:
            if name.startswith(RESTORE_TMP_PREFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(dirpath, name))
