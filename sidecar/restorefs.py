"""Writing restored files with the sidecar's safety rules: never through a symlink, never outside
a root, atomically (temp file, rename) and checked against the stored hash; and the records at the
top of a root: the restore marker, the kept keys and the lineage. Blocking functions; callers run
them in worker threads. Reading and scanning local files is :mod:`sidecar.localfs`'s."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from typing import Callable

from sidecar.localfs import MAX_MTIME_NS, UnsafeTarget, open_child_dir, open_dir_nofollow, open_root
from sidecar.log import printable
from sidecar.paths import KEPT_FILE, LINEAGE_FILE, RESERVED_NAMES, RESTORE_MARKER, RESTORE_TMP_PREFIX, IgnoreRules, Root


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
    (secret-free, its prefix included), the namespace path, the generation of the namespace's
    state the disk holds (the owner marker's; None in a record that carries none), and
    ``version``: the highest version the store can hold of what this disk's sidecar wrote or
    restored (recorded before each write is sent; None in a record that carries none). A store
    holding a higher version has moved on from this disk (a copy taken earlier): merged."""

    store: str
    namespace: str
    generation: int | None = None
    version: int | None = None
    #: the namespace's lineage id its owner marker carried (:func:`sidecar.marker.marker_lineage`;
    #: None: not known): a record under another id is another namespace's state at the same place
    marker: str | None = None


#: The lineage record is tiny; anything larger is not ours.
MAX_LINEAGE_BYTES = 64 * 1024


def read_lineage(root: Root) -> Lineage | None:
    """The lineage recorded at the top of ``root`` (a bounded regular file read without following
    links); None when there is none, it cannot be read, or it is not ours
    (:func:`read_lineage_why` tells the last two apart)."""
    return read_lineage_why(root)[0]


def read_lineage_why(root: Root) -> tuple[Lineage | None, str | None]:
    """:func:`read_lineage`'s record and, when a record is there but cannot be read as one (not a
    regular file, unreadable, larger than :data:`MAX_LINEAGE_BYTES`, malformed), why: such a
    record may name another namespace, so it is never taken for none (:func:`check_foreign`)."""
    try:
        dfd = open_root(root.path, create=False)
    except OSError:
        return None, None  # no root: no record (an unreadable root is refused as such)
    try:
        fd = os.open(LINEAGE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        return None, (None if e.errno == errno.ENOENT else
                      "a symbolic link" if e.errno == errno.ELOOP else e.strerror or type(e).__name__)
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "not a regular file"
        raw = os.read(fd, MAX_LINEAGE_BYTES + 1)
    except OSError as e:
        return None, e.strerror or type(e).__name__
    finally:
        os.close(fd)
    try:
        record = json.loads(raw) if len(raw) <= MAX_LINEAGE_BYTES else None
    except (ValueError, RecursionError):  # malformed, or nested past the parser's depth
        return None, "not a JSON object"
    if not isinstance(record, dict) or not isinstance(record.get("store"), str) \
            or not isinstance(record.get("namespace"), str):
        return None, "not a lineage record (no store and namespace)"
    generation, version = (_count(record.get(name)) for name in ("generation", "version"))
    marker = record.get("marker") if isinstance(record.get("marker"), str) and len(record["marker"]) <= 64 else None
    return Lineage(record["store"], record["namespace"], generation, version, marker), None


def _count(value: object) -> int | None:
    """A record's whole number; None when missing or not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def write_lineage(root: Root, lineage: Lineage, durable: bool = True) -> None:
    """Record ``lineage`` at the top of ``root``, atomically (temp file, rename) and, ``durable``,
    with the file and the directory fsynced: after a crash the root carries the old record or the
    new, whole. Not ``durable`` (a version raised before a write): a power cut may bring back the
    record before it, which only makes the disk merged, never the truth. The root is never
    created: FileNotFoundError when it does not exist."""
    dfd = open_root(root.path, create=False)
    try:
        tmp = RESTORE_TMP_PREFIX + secrets.token_hex(6)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            try:
                record: dict[str, object] = {"store": lineage.store, "namespace": lineage.namespace}
                if lineage.generation is not None:
                    record["generation"] = lineage.generation
                if lineage.version is not None:
                    record["version"] = lineage.version
                if lineage.marker is not None:
                    record["marker"] = lineage.marker
                os.write(fd, json.dumps(record).encode())
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, LINEAGE_FILE, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        if durable:
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


# -- an exact restore: what the point lacks is moved beside the root -----------------------------


@dataclass
class Aside:
    """What an exact restore (``restore --as-of --force-restore``) moves out of one root
    (:func:`plan_aside`), and once :func:`set_aside` has moved it, where to: a new directory
    beside the root (``into``), each entry at its own relative path there."""

    root: Root
    entries: list[str]  # files, symlinks, other non-directories and ``whole`` (relative paths)
    dirs: list[str]  # directories left empty by the moves (or empty already), deepest first
    into: str = ""
    moved: int = 0
    whole: set[str] = field(default_factory=set)  # directories where the point has a file: renamed whole

    @property
    def paths(self) -> list[str]:
        """Every entry moved, a directory with a trailing ``/``."""
        return [*(e + "/" if e in self.whole else e for e in self.entries), *(d + "/" for d in self.dirs)]


class CannotSetAside(Exception):
    """One line: why what the point lacks cannot be moved out of a root (``moved`` of its
    entries were, into ``into``; none: nothing in the root was changed)."""

    def __init__(self, message: str, moved: int = 0, into: str = "") -> None:
        super().__init__(message)
        self.moved, self.into = moved, into


def aside_parent(root: Root) -> str:
    """The directory that holds the root's real directory (the root may be a link an operator
    configured): set-aside directories are made there, on the root's filesystem, outside every root."""
    return os.path.dirname(os.path.realpath(root.path))


def plan_aside(root: Root, keep: set[str], ignore: IgnoreRules,
               differs: Callable[[str], bool] = lambda rel: False) -> Aside:
    """What is in ``root`` that the point lacks (``keep``: the relative paths of the point's
    files): every non-directory entry (a symlink is an entry, never followed) not in ``keep`` as
    a regular file and not ignored (ignored names, the sidecar's records among them, stay), every
    regular file in ``keep`` whose bytes ``differs`` from the point's (the point's is written in
    its place: the local one is kept beside the root, never overwritten), then every directory
    with nothing of ``keep`` below it that is left empty. Directories named like
    the sidecar's own store records are left whole. :class:`CannotSetAside` (nothing is changed)
    when a directory cannot be read or an entry is on another filesystem than the root's parent
    (a rename cannot move it there)."""
    try:
        top = os.stat(root.path)
    except FileNotFoundError:
        return Aside(root, [], [])
    except OSError as e:
        raise CannotSetAside(f"cannot read {printable(root.path)}: {e.strerror}") from None
    if not stat.S_ISDIR(top.st_mode):
        return Aside(root, [], [])
    parent = aside_parent(root)
    try:
        dev = os.stat(parent).st_dev
    except OSError as e:
        raise CannotSetAside(f"cannot read {printable(parent)}: {e.strerror}") from None
    below = {rel.rsplit("/", i)[0] for rel in keep for i in range(1, rel.count("/") + 1)}
    entries: list[str] = []
    whole: set[str] = set()
    order: list[tuple[str, int]] = []  # directories, parents first, with their device
    left: dict[str, int] = {}  # directory -> entries staying in it
    stack: list[tuple[str, int]] = [("", top.st_dev)]
    while stack:
        rel, here = stack.pop()
        order.append((rel, here))
        left[rel] = 0
        try:
            fd = open_dir_nofollow(root.path, rel.split("/") if rel else [], create=False)
            try:
                listing = [(e.name, st) for e in os.scandir(fd) if (st := _lstat(e)) is not None]
            finally:
                os.close(fd)
        except (OSError, UnsafeTarget) as e:
            why = e.strerror if isinstance(e, OSError) else str(e)
            raise CannotSetAside(f"cannot read {printable(os.path.join(root.path, rel))} ({why}): an exact "
                                 "restore must see every file it would move aside") from None
        for name, st in listing:
            sub = f"{rel}/{name}" if rel else name
            if stat.S_ISDIR(st.st_mode):
                if name in RESERVED_NAMES:
                    left[rel] += 1
                elif sub in keep and st.st_dev == dev:
                    entries.append(sub)  # where the point has a file: moved whole, ignored names and all
                    whole.add(sub)
                else:
                    stack.append((sub, st.st_dev))
            elif (stat.S_ISREG(st.st_mode) and sub in keep and not differs(sub)) or ignore.ignored(name):
                left[rel] += 1
            elif here != dev:
                raise CannotSetAside(f"cannot move {printable(os.path.join(root.path, sub))} beside the root: it is on "
                                     f"another filesystem than {printable(parent)} (a mount point); empty the root "
                                     "yourself, or restore into an empty one")
            else:
                entries.append(sub)
    dirs: list[str] = []
    for rel, here in reversed(order):  # children before their parents
        if rel == "":
            continue
        if left[rel] == 0 and rel not in below and here == dev:
            dirs.append(rel)
        else:
            left[rel.rpartition("/")[0]] += 1
    _check_movable(root, entries, dirs)
    return Aside(root, entries, dirs, whole=whole)


def _check_movable(root: Root, entries: list[str], dirs: list[str]) -> None:
    """:class:`CannotSetAside` before anything moves when a rename would fail part way: an entry
    that is (or a directory that holds) a mount point (a bind-mounted file shares its
    filesystem's device, so only the mount table tells), or a directory it leaves that this
    process may not write."""
    real = os.path.realpath(root.path)
    moved = [os.path.join(real, p) for p in [*entries, *dirs]]
    for mount in _mount_points():
        if any(mount == m or mount.startswith(m + "/") for m in moved):
            raise CannotSetAside(f"cannot move {printable(mount)} beside the root: it is a mount point; empty the "
                                 "root yourself, or restore into an empty one")
    for parent in sorted({os.path.dirname(m) for m in moved}):
        if not os.access(parent, os.W_OK | os.X_OK):
            raise CannotSetAside(f"cannot move entries out of {printable(parent)}: it is not writable by this "
                                 "process")


def _mount_points() -> list[str]:
    """This process's mount points (``/proc/self/mountinfo``, field 5, octal escapes undone);
    none where it cannot be read."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(b" ")
        if len(fields) > 4:
            out.append(os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])))
    return out


def set_aside(aside: Aside, stamp: str) -> None:
    """Move ``aside``'s entries, then its directories, out of the root into a new directory
    beside it, ``.<root name>.replaced-<stamp>`` (``-2``... when taken), each at its relative
    path (renames on one filesystem: nothing is copied, nothing deleted; an empty directory
    already made there for its moved content is only removed from the root).
    :class:`CannotSetAside` when a rename fails, saying how many were moved (none: the new
    directory is removed again and the root is as it was)."""
    root = aside.root
    base = os.path.join(aside_parent(root), "." + os.path.basename(root.path).lstrip(".") + ".replaced-" + stamp)
    for n in range(1, 100):
        aside.into = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(aside.into, 0o700)
            break
        except FileExistsError:
            continue
        except OSError as e:
            raise CannotSetAside(f"cannot make {printable(aside.into)} to move the files the point lacks into: "
                                 f"{e.strerror}") from None
    else:
        raise CannotSetAside(f"cannot make a directory to move the files the point lacks into: {printable(base)} "
                             "and its numbered names are taken")
    target, made = Root(root.name, aside.into), OpenDirs()
    try:
        for rel in aside.paths:
            parts = rel.rstrip("/").split("/")
            sfd = open_dir_nofollow(root.path, parts[:-1], create=False)
            try:
                dfd = made.get(target, parts[:-1])
                if rel.endswith("/") and _exists(parts[-1], dfd):
                    os.rmdir(parts[-1], dir_fd=sfd)  # (its content moved there already: empty)
                else:
                    _move(parts[-1], sfd, dfd)
            finally:
                os.close(sfd)
            aside.moved += 1
    except (OSError, UnsafeTarget) as e:
        why = e.strerror if isinstance(e, OSError) else str(e)
        failed = printable(os.path.join(root.path, rel))
        if aside.moved == 0:
            made.close()
            for path, _dirs, _files in os.walk(aside.into, topdown=False):  # directories only: nothing moved
                with contextlib.suppress(OSError):
                    os.rmdir(path)
        raise CannotSetAside(f"cannot move {failed} into {printable(aside.into)}: {why}", aside.moved,
                             aside.into) from None
    finally:
        made.close()


def _lstat(entry: os.DirEntry[str]) -> os.stat_result | None:
    try:
        return entry.stat(follow_symlinks=False)
    except FileNotFoundError:  # gone since listed
        return None


def _move(name: str, sfd: int, dfd: int) -> None:
    """Rename ``name`` from the directory ``sfd`` to the same name in ``dfd`` (a symlink is moved
    itself, never followed)."""
    os.rename(name, name, src_dir_fd=sfd, dst_dir_fd=dfd)


def _exists(name: str, dfd: int) -> bool:
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
