"""Local file access with the sidecar's safety rules: never follow a symlink, never read a torn file,
never write outside a root. Blocking functions; callers run them in worker threads."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import stat
from collections import deque
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import AsyncIterator, Generator

import anyio

from sidecar import log
from sidecar.paths import MAX_KEY_BYTES, RESERVED_NAMES, IgnoreRules, Root
from sidecar.store.base import CHUNK_BYTES, ObjectMeta


@dataclass(frozen=True, slots=True)
class LocalStat:
    size: int
    mtime_ns: int
    mode: int
    ino: int = 0  # with ctime_ns: two equal scans mean nothing changed in between
    ctime_ns: int = 0


@dataclass
class Gaps:
    """What a scan could not see, or sees but cannot mirror. What cannot be read is never taken
    for deleted: stored keys below an unreadable directory are kept (:meth:`covers`)."""

    unreadable: dict[str, str] = field(default_factory=dict)  # directory key (or a root's name) -> why
    unstorable: list[str] = field(default_factory=list)  # files whose key is longer than a store allows

    def covers(self, key: str) -> bool:
        """``key`` lies in (or is) a directory the scan could not read."""
        return any(key == d or key.startswith(d + "/") for d in self.unreadable)

    def merge(self, other: "Gaps") -> None:
        self.unreadable.update(other.unreadable)
        self.unstorable.extend(other.unstorable)


def root_identity(path: str) -> tuple[int, int] | None:
    """The root directory at ``path`` (a link to one followed, as the watcher does) as (st_dev,
    st_ino); None when nothing, or something other than a directory, is there, or it cannot be
    stat-ed: a root whose identity changes was removed or replaced as a whole."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def absent(root: Root, rel: str) -> bool:
    """No regular file is at ``rel`` under ``root`` for sure: nothing there, or a non-file (a
    symlink, a directory). An error other than 'not found' (a parent unreadable, I/O) is not
    absence: such a file may be there, and its stored copy must be kept."""
    try:
        return not stat.S_ISREG(os.lstat(os.path.join(root.path, rel)).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False


#: The largest mtime a file can be given (signed 64-bit nanoseconds).
MAX_MTIME_NS = 2**63


class Vanished(Exception):
    """The file is gone (or is no longer a regular file)."""


class Unstable(Exception):
    """The file kept changing while it was read."""


class TooLarge(Exception):
    pass


def scan_root(root: Root, ignore: IgnoreRules, gaps: Gaps | None = None) -> tuple[dict[str, LocalStat], list[str]]:
    """Regular files under ``root`` by key (symlinks and ignored names skipped), and the skipped
    symlinks' keys. A missing root is empty. Directories that cannot be read (permissions, I/O
    errors) and files that cannot be stored are recorded in ``gaps``."""
    gaps = Gaps() if gaps is None else gaps
    files: dict[str, LocalStat] = {}
    links: list[str] = []
    ignored = ignore.ignored
    stack = [(root.name, root.path)]  # directory entries are plain names: keys need no re-validation
    while stack:
        rel_dir, abs_dir = stack.pop()
        try:
            it = os.scandir(abs_dir)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as e:
            gaps.unreadable[rel_dir] = e.strerror or type(e).__name__
            continue
        with it:
            try:
                for entry in it:
                    key = f"{rel_dir}/{entry.name}"
                    if "\\" in entry.name or (not entry.name.isascii() and not _utf8(entry.name)):
                        if not ignored(entry.name):
                            _refuse_once(key)  # never mirrored, whatever the store (see unmirrorable_reason)
                        continue
                    try:
                        if entry.is_symlink():
                            links.append(key)
                        elif entry.is_dir(follow_symlinks=False):
                            if entry.name not in RESERVED_NAMES:  # a nested namespace's own records: never mirrored
                                stack.append((key, entry.path))
                        elif entry.is_file(follow_symlinks=False) and not ignored(entry.name):
                            if len(key) > MAX_KEY_BYTES and len(key.encode("utf-8", "surrogateescape")) > MAX_KEY_BYTES:
                                gaps.unstorable.append(key)
                                continue
                            st = entry.stat(follow_symlinks=False)
                            files[key] = LocalStat(
                                st.st_size, st.st_mtime_ns, st.st_mode & 0o7777, st.st_ino, st.st_ctime_ns
                            )
                    except FileNotFoundError:
                        continue  # vanished mid-scan
                    except OSError as e:  # listed but not stat-able (a directory without x permission)
                        gaps.unreadable[rel_dir] = e.strerror or type(e).__name__
                        continue
            except OSError as e:  # the listing failed part way (an I/O error, a /proc entry)
                gaps.unreadable[rel_dir] = e.strerror or type(e).__name__
    return files, links


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:  # undecodable bytes, kept by Python as lone surrogates
        return False


def unmirrorable_reason(name: str) -> str | None:
    """Why a file or directory name can never be mirrored (None when it can).

    * not valid UTF-8 (``b"\\xff\\xfe.json"``): Azure blob names are UTF-8, and the same tree must
      give the same store content whichever store is used, so such names are refused everywhere;
    * a backslash: Azure turns it into ``/`` (a different path on restore), and stored names
      with a backslash are refused on restore.

    The hosts only ever write UTF-8 names without backslashes (uuids, ids, ``*.json``)."""
    if "\\" in name:
        return "the name contains a backslash (a store would turn it into a path separator)"
    if not _utf8(name):
        return "the name is not valid UTF-8 (blob names must be; refused for every store alike)"
    return None


#: Names already warned about as never mirrored.
_REFUSED = log.Once()


def _refuse_once(key: str) -> None:
    if not _REFUSED.first(key):
        return
    log.warning("unmirrorable_name", path=log.no_surrogates(key),
                reason=unmirrorable_reason(key.rsplit("/", 1)[-1]) or "unsupported name",
                detail="never mirrored: rename it (a directory's whole tree is skipped)")


_DEFAULT_RULES = IgnoreRules()


def has_regular_files(path: str, ignore: IgnoreRules | None = None) -> bool:
    """True when the tree holds at least one regular file that is state: empty placeholder
    directories, names ``ignore`` says are never mirrored (a writer's temp file) and the
    sidecar's own files (:data:`~sidecar.paths.INTERNAL_IGNORE`, whatever ``ignore`` says) don't
    count. ``ignore`` defaults to the default rules. A directory that cannot be read may hold
    files: True (what cannot be read is never taken for empty)."""
    ignored = (ignore or _DEFAULT_RULES).ignored
    stack = [path]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            return True
        with it:
            for entry in it:
                if entry.is_file(follow_symlinks=False) and not ignored(entry.name):
                    return True
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return False


def _open_file_nofollow(root: Root, parts: list[str]) -> int:
    """An fd of the regular file ``root/parts...`` reached without following any symlink below the
    root; :class:`Vanished` when there is none."""
    try:
        dfd = open_dir_nofollow(root.path, parts[:-1], create=False)
    except (FileNotFoundError, NotADirectoryError, UnsafeTarget):
        raise Vanished("/".join(parts)) from None
    try:
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except (FileNotFoundError, NotADirectoryError):
        raise Vanished("/".join(parts)) from None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink: never followed
            raise Vanished("/".join(parts)) from None
        raise
    finally:
        os.close(dfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Vanished("/".join(parts))
    return fd


def _same_version(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_size == b.st_size and a.st_mtime_ns == b.st_mtime_ns and a.st_ctime_ns == b.st_ctime_ns
            and a.st_ino == b.st_ino)


def read_stable(root: Root, parts: list[str], max_size: int, attempts: int = 5) -> tuple[bytes, ObjectMeta]:
    """The bytes and metadata of ``root/parts...``, reached without following any symlink below
    the root, and only if the file did not change while it was read (retried ``attempts`` times)."""
    for _ in range(attempts):
        fd = _open_file_nofollow(root, parts)
        try:
            before = os.fstat(fd)
            if before.st_size > max_size:
                raise TooLarge(f"{before.st_size} bytes > limit {max_size}")
            chunks = []
            while True:
                chunk = os.read(fd, max(before.st_size + 1, 65536))
                if not chunk:
                    break
                chunks.append(chunk)
            data = b"".join(chunks)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if len(data) == after.st_size and _same_version(before, after):
            return data, ObjectMeta.of(data, after.st_mtime_ns, after.st_mode)
    raise Unstable("/".join(parts))


#: Files above this size are streamed both ways (never held whole in memory), in chunks of
#: STREAM_CHUNK bytes. Smaller ones go in one request (a store may hold such a body whole).
STREAM_MIN = 8 * 1024 * 1024
STREAM_CHUNK = CHUNK_BYTES
#: Files up to this size are read and sent whole without asking the :class:`ByteBudget` (at most
#: ``concurrency`` times this in memory): the 1-100 KiB checkpoints never wait for it.
SMALL_BODY = 1024 * 1024
#: The bytes of file bodies the uploads (or the downloads) of one process hold at once, larger
#: than SMALL_BODY: a whole file up to STREAM_MIN, one chunk for a streamed one.
BODY_BUDGET = 32 * 1024 * 1024


def body_bytes(size: int) -> int:
    """What an upload or download of a file of ``size`` bytes takes from the :class:`ByteBudget`."""
    if size <= SMALL_BODY:
        return 0
    return size if size <= STREAM_MIN else STREAM_CHUNK


class ByteBudget:
    """A byte count shared by concurrent transfers, taken first come first served: a transfer
    waits until its bytes fit, so the bodies in memory never exceed ``total`` whatever the
    concurrency and the file sizes. A request above ``total`` takes all of it."""

    def __init__(self, total: int = BODY_BUDGET) -> None:
        self.total = total
        self.used = 0
        self._waiting: deque[tuple[int, anyio.Event]] = deque()

    @asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        n = min(n, self.total)
        if n <= 0:
            yield
            return
        await self._acquire(n)
        try:
            yield
        finally:
            self._release(n)

    async def _acquire(self, n: int) -> None:
        if not self._waiting and self.used + n <= self.total:
            self.used += n
            return
        granted = anyio.Event()
        entry = (n, granted)
        self._waiting.append(entry)
        try:
            await granted.wait()
        except BaseException:
            if granted.is_set():  # granted as it was cancelled: give it back
                self._release(n)
            else:
                self._waiting.remove(entry)
                self._grant()  # it may have held back the ones behind it
            raise

    def _release(self, n: int) -> None:
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self.used + self._waiting[0][0] <= self.total:
            n, granted = self._waiting.popleft()
            self.used += n
            granted.set()


@dataclass
class FileSource:
    """A large file to store, read in chunks, never whole. Its metadata was hashed from one stable
    read; every later read checks that it still is that version, and fails (:class:`Unstable`)
    after its last chunk otherwise, so a store never commits bytes it was not told the hash of."""

    root: Root
    parts: list[str]
    size: int
    sha256: str
    md5: bytes  # the whole file's, for stores that record a Content-MD5
    version: tuple[int, int, int, int]  # size, mtime_ns, ctime_ns, inode of the hashed read

    def iter_sync(self) -> Generator[bytes, None, None]:
        """The file's chunks, read here (blocking); raises Unstable after the last if it changed."""
        fd = _open_file_nofollow(self.root, self.parts)
        try:
            digest = hashlib.sha256()
            while chunk := os.read(fd, STREAM_CHUNK):
                digest.update(chunk)
                yield chunk
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) != self.version or digest.hexdigest() != self.sha256:
            raise Unstable("/".join(self.parts))

    async def chunks(self) -> AsyncIterator[bytes]:
        """:meth:`iter_sync` with every read in a worker thread."""
        import anyio.to_thread

        it = self.iter_sync()  # a generator: closed below
        done = object()
        try:
            while (chunk := await anyio.to_thread.run_sync(next, it, done)) is not done:
                yield chunk  # type: ignore[misc]
        finally:
            it.close()


def read_for_upload(root: Root, parts: list[str], max_size: int,
                    read_max: int = STREAM_MIN) -> "tuple[bytes | FileSource, ObjectMeta] | int":
    """What to upload for ``root/parts...``: its bytes (:func:`read_stable`), or for a file above
    :data:`STREAM_MIN` a :class:`FileSource` (:func:`hash_stable`) that the store streams. For a
    file above ``read_max`` bytes, only its size, read nothing yet: the caller takes what the
    transfer needs from its :class:`ByteBudget` (:func:`body_bytes`), then asks again."""
    fd = _open_file_nofollow(root, parts)
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size > read_max:
        return size
    if size > STREAM_MIN:
        return hash_stable(root, parts, max_size)
    return read_stable(root, parts, max_size)


def hash_stable(root: Root, parts: list[str], max_size: int, attempts: int = 5) -> tuple[FileSource, ObjectMeta]:
    """Like :func:`read_stable` for a large file: hashed in chunks, never held; the source reads
    it again for the store."""
    for _ in range(attempts):
        fd = _open_file_nofollow(root, parts)
        try:
            before = os.fstat(fd)
            if before.st_size > max_size:
                raise TooLarge(f"{before.st_size} bytes > limit {max_size}")
            sha, md5, size = hashlib.sha256(), hashlib.md5(), 0
            while chunk := os.read(fd, STREAM_CHUNK):
                sha.update(chunk)
                md5.update(chunk)
                size += len(chunk)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if size == after.st_size and _same_version(before, after):
            source = FileSource(root, list(parts), size, sha.hexdigest(), md5.digest(),
                                (after.st_size, after.st_mtime_ns, after.st_ctime_ns, after.st_ino))
            return source, ObjectMeta(size, source.sha256, after.st_mtime_ns, after.st_mode & 0o7777)
    raise Unstable("/".join(parts))


def below_root_without_links(root: Root, rel: str) -> bool:
    """True when no directory between ``root`` and ``rel``'s parent is a symlink (cheap pre-check
    for watcher hints; :func:`read_stable` enforces it race-free)."""
    parent = os.path.dirname(rel)
    if not parent:
        return True
    real_root = os.path.realpath(root.path)
    return os.path.realpath(os.path.join(root.path, parent)) == os.path.join(real_root, parent)


def release_free_memory() -> None:
    """Return freed heap pages to the system (glibc ``malloc_trim``); a no-op elsewhere."""
    with suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


#: Local files are hashed in chunks of this size when compared with their stored version.
HASH_CHUNK = 1024 * 1024


def local_matches(root: Root, parts: list[str], size: int, sha256: str | None) -> bool | None:
    """Whether the regular file at ``root/parts...`` (reached without following any symlink below
    the root) holds the bytes of size ``size`` and hash ``sha256``: None when there is no such
    file, False when it differs (a different size, or a hash that cannot be compared). Hashed a
    chunk at a time, so memory stays bounded whatever the size."""
    try:
        fd = _open_file_nofollow(root, parts)
    except Vanished:
        return None
    except OSError:
        return False  # there, but unreadable: the stored version replaces it
    try:
        if os.fstat(fd).st_size != size or sha256 is None:
            return False
        digest = hashlib.sha256()
        while chunk := os.read(fd, HASH_CHUNK):
            digest.update(chunk)
        return digest.hexdigest() == sha256
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclass
class StoredCopy:
    """The file ``root/parts...`` read as the bytes of a stored object (size ``size``, hash
    ``sha256``): its chunks, reached without following any symlink below the root, and
    :class:`Unstable` after the last (:class:`Vanished` at the start) when the disk no longer
    holds those very bytes. For a restore point's members (:mod:`sidecar.points.writer`)."""

    root: Root
    parts: list[str]
    size: int
    sha256: str

    def iter_sync(self) -> Generator[bytes, None, None]:
        fd = _open_file_nofollow(self.root, self.parts)
        try:
            digest, n = hashlib.sha256(), 0
            while n <= self.size and (chunk := os.read(fd, STREAM_CHUNK)):
                digest.update(chunk)
                n += len(chunk)
                yield chunk
        finally:
            os.close(fd)
        if n != self.size or digest.hexdigest() != self.sha256:
            raise Unstable("/".join(self.parts))


class UnsafeTarget(Exception):
    """A restore target would pass through a symlink or a non-directory."""


def open_child_dir(fd: int, part: str, root_path: str, create: bool) -> int:
    """The directory ``part`` under the directory ``fd``, never through a symlink; made if missing
    and ``create``."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            return os.open(part, flags, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
            with suppress(FileExistsError):
                os.mkdir(part, 0o700, dir_fd=fd)
            return os.open(part, flags, dir_fd=fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeTarget(f"{part!r} under {root_path} is a symlink or not a directory") from None
        raise


def root_failure(root_path: str, e: OSError) -> str:
    """Why a root could not be opened or created, in words: for a symbolic link whose target is
    missing (a volume that was never mounted), the link and its target rather than ``File exists``."""
    with suppress(OSError):
        if os.path.islink(root_path) and not os.path.exists(root_path):
            return (f"it is a symbolic link to {log.printable(os.readlink(root_path))}, which does not exist "
                    "(a volume that was not mounted?)")
    return e.strerror or type(e).__name__


def open_root(root_path: str, create: bool) -> int:
    if create:
        os.makedirs(root_path, mode=0o700, exist_ok=True)
    return os.open(root_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def open_dir_nofollow(root_path: str, parts: list[str], create: bool) -> int:
    """A directory fd for ``root_path/parts...`` walking one component at a time without
    following symlinks (the root itself may be a symlink an operator configured)."""
    fd = open_root(root_path, create)
    try:
        for part in parts:
            nfd = open_child_dir(fd, part, root_path, create)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise
