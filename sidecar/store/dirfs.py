"""The directory store's file-system layer: its layout names, directories and files opened one
component at a time with ``O_NOFOLLOW`` (a symlink below the base is :class:`_Link`, never followed),
bounded reads of metadata records, durable (fsynced) writes and unlinks, and the key's lock file name.
The rules of the store itself are :mod:`sidecar.store.directory`'s."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
import sys
from typing import Callable

from sidecar.store.base import OWN_NAMESPACE, Source

META_DIR = ".sidecar-meta"
TMP_PREFIX = ".sidecar-tmp-"
#: A temp file is removed by another writer only when no live writer holds its ``flock`` and it
#: is at least this old by the store's clock (its mtime against a file just made beside it): the
#: age covers the instant between a temp's creation and its writer's lock.
TEMP_GRACE_NS = 60 * 10**9
#: Entries read per worker-thread call while listing.
LIST_BATCH = 256
LONG_META_PREFIX = ".sidecar-long-"
NAME_MAX = 255  # bytes in one file name (ext4, xfs, tmpfs, NFS, SMB)
#: The sidecar's own objects (owner marker, bundles): written with their stamp as the mtime too.
OWN_PREFIX = OWN_NAMESPACE + "/"
#: File mtimes below this are stamps, not wall-clock times (2^52 ns is in 1970).
MAX_STAMP_MTIME = 2**52
#: In ``.sidecar-meta/``: the own objects' lock, and the data keys' lock files (a prefix of).
OWN_LOCK = ".sidecar-lock"
KEY_LOCK_PREFIX = ".sidecar-lock-"
#: Data keys hash to this many lock files: puts of different keys rarely wait for each other.
LOCK_STRIPES = 64


def _bounded(value: object) -> int:
    """A non-negative integer of a record, or 0 (a record edited by hand)."""
    number = int(value)  # type: ignore[call-overload]
    return number if 0 <= number < 2**63 else 0


#: A metadata record is a small JSON object; anything larger is not one of ours.
MAX_RECORD_BYTES = 4096
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

RACE_ATTEMPTS = 10  # makedirs/open retries against concurrent pruning of empty directories


class _Link(Exception):
    """A symlink where the store needs a directory or a file of its own: never followed.
    ``where`` is its path below the store's base."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


def _identity(path: str) -> int | None:
    """Which directory ``path`` is, following links: its inode (None when it cannot be read).
    Not its device: a network or FUSE volume mounted again gets a new device number, yet is the
    same store; an empty mount point in its place is another inode than the volume's root."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _lstat_at(dfd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _child_dir(dfd: int, name: str, where: str) -> int:
    """The directory ``name`` under ``dfd``, never through a symlink (:class:`_Link`);
    FileNotFoundError when missing, NotADirectoryError when something else stands there."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dfd)
    except NotADirectoryError:  # O_NOFOLLOW|O_DIRECTORY answers ENOTDIR for a symlink too
        st = _lstat_at(dfd, name)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise _Link(where) from None
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Link(where) from None
        raise


def _open_dir(top: str, parts: list[str], create: bool) -> int:
    """A descriptor of ``top/parts...``, opened one component at a time without following a
    symlink below ``top`` (``top`` itself may be one); missing directories are made when
    ``create``, again when a concurrent delete prunes them meanwhile."""
    for attempt in range(RACE_ATTEMPTS):
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, part in enumerate(parts):
                where = "/".join(parts[:i + 1])
                try:
                    nfd = _child_dir(fd, part, where)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, 0o777, dir_fd=fd)
                    except FileExistsError:
                        pass
                    else:  # its entry is durable before anything is stored below it
                        _fsync_dir(fd)
                    nfd = _child_dir(fd, part, where)
                os.close(fd)
                fd = nfd
            return fd
        except FileNotFoundError:
            os.close(fd)
            if not create or attempt == RACE_ATTEMPTS - 1:
                raise
        except BaseException:
            os.close(fd)
            raise
    raise AssertionError("unreachable")


def _rel_parts(path: str, top: str) -> list[str]:
    return os.path.relpath(path, top).split(os.sep)


def _read_record_at(dfd: int | None, name: str) -> dict | None:
    """A metadata record, or None when there is none that can be read safely: missing, not a
    regular file (a symlink, a FIFO), too large, or not a small JSON object."""
    if dfd is None:
        return None
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, MAX_RECORD_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > MAX_RECORD_BYTES:
        return None
    try:
        rec = json.loads(raw)
    except (ValueError, RecursionError):  # malformed, or nested past the parser's depth
        return None
    return rec if isinstance(rec, dict) else None


def _meta_name(name: str) -> str:
    """The metadata record's file name for a data file called ``name``."""
    if len(name.encode("utf-8", "surrogateescape")) + len(".json") <= NAME_MAX:
        return name + ".json"
    return LONG_META_PREFIX + hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest() + ".json"


def _meta_path(top: str, rel: str) -> str:
    head, _, name = rel.rpartition("/")
    return os.path.join(top, META_DIR, *([head] if head else []), _meta_name(name))


def _child_dir_if(dfd: int, name: str, where: str) -> int | None:
    """:func:`_child_dir`, or None when ``name`` is gone (a concurrent delete pruned it)."""
    try:
        return _child_dir(dfd, name, where)
    except FileNotFoundError:
        return None


def _files_below(dfd: int, parts: list[str], where: Callable[[list[str]], str]) -> list[str]:
    """The keys of the files below the directory ``dfd`` (the key path ``parts``); a symlink
    among them is :class:`_Link` (it is not ours to remove), named by ``where(its parts)``.
    A concurrent delete may prune a directory among them meanwhile: its files are gone."""
    out: list[str] = []
    try:
        entries = list(os.scandir(dfd))
    except FileNotFoundError:  # (a pruned directory, where the filesystem says so)
        return out
    for entry in entries:
        sub = parts + [entry.name]
        if entry.is_symlink():
            raise _Link(where(sub))
        if entry.is_dir(follow_symlinks=False):
            if (cfd := _child_dir_if(dfd, entry.name, where(sub))) is None:
                continue
            try:
                out += _files_below(cfd, sub, where)
            finally:
                os.close(cfd)
        elif not entry.name.startswith(TMP_PREFIX):
            out.append("/".join(sub))
    return out


def _rmtree_at(dfd: int, name: str) -> None:
    """:func:`shutil.rmtree` of the directory ``name`` in ``dfd`` (never through a symlink); what
    a concurrent delete removed meanwhile (a file, a directory it pruned) is gone already."""
    def gone_or_raise(_func: object, _path: str, exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise exc

    if sys.version_info >= (3, 12):
        shutil.rmtree(name, dir_fd=dfd, onexc=gone_or_raise)
    else:
        shutil.rmtree(name, dir_fd=dfd, onerror=lambda func, path, info: gone_or_raise(func, path, info[1]))


def _fsync_dir(fd: int) -> None:
    os.fsync(fd)


def _remove_durably(path: str, top: str) -> None:
    """Unlink ``path`` (if there) and fsync its directory, reached from ``top`` without following
    a symlink (:class:`_Link`, also for a symlink at ``path`` itself: it is not removed)."""
    *head, name = _rel_parts(path, top)
    try:
        dfd = _open_dir(top, head, create=False)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        st = _lstat_at(dfd, name)
        if st is None:
            return
        if stat.S_ISLNK(st.st_mode):
            raise _Link("/".join(head + [name]))
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            return
        _fsync_dir(dfd)
    finally:
        os.close(dfd)


def _unlink_durably(dfd: int, name: str) -> bool:
    """Unlink ``name`` in ``dfd`` and fsync the directory; False when it was not there."""
    try:
        os.unlink(name, dir_fd=dfd)
    except (FileNotFoundError, IsADirectoryError):
        return False
    _fsync_dir(dfd)
    return True


def _new_temp(dfd: int) -> tuple[str, int]:
    """A new temp file in ``dfd``: its name and its descriptor, ``flock``'ed until closed, which
    tells every other writer's clean-up that it is in flight (:func:`_clean_temps_below`)."""
    name = TMP_PREFIX + secrets.token_hex(6)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # (a clean-up may hold it for an instant: it then sees it new)
    except BaseException:
        os.close(fd)
        _unlink_quietly(dfd, name)
        raise
    return name, fd


def _fill(fd: int, data: "bytes | Source", mode: int, mtime_ns: int | None) -> os.stat_result:
    """Write ``data`` to the temp file ``fd``, set its mode and mtime and fsync it; its final
    status. ``fd`` stays open (and the temp locked) until the caller has renamed it."""
    with os.fdopen(fd, "wb", closefd=False) as f:
        if isinstance(data, bytes):
            f.write(data)
        else:  # streamed; raises after the last chunk if the source changed
            for chunk in data.iter_sync():
                f.write(chunk)
        f.flush()
        os.fchmod(fd, mode & 0o7777)
        if mtime_ns is not None:
            os.utime(fd, ns=(mtime_ns, mtime_ns))
        os.fsync(fd)
        return os.fstat(fd)


def _nearest_dir(top: str, parts: list[str]) -> int:
    """A descriptor of ``top/parts...``, or of the nearest directory above it that exists (never
    through a symlink below ``top``); FileNotFoundError when not even ``top`` does."""
    for n in range(len(parts), -1, -1):
        try:
            return _open_dir(top, parts[:n], False)
        except FileNotFoundError:
            if n == 0:
                raise
    raise AssertionError("unreachable")


def _temp_in(top: str, parts: list[str]) -> tuple[int, str, int]:
    """A new temp file in the directory ``top/parts...`` (made if missing, never through a
    symlink): the directory's descriptor, the temp's name and its descriptor."""
    for attempt in range(RACE_ATTEMPTS):
        dfd = _open_dir(top, parts, create=True)
        try:
            name, fd = _new_temp(dfd)
        except FileNotFoundError:
            # A concurrent delete pruned the empty directory between its open and the temp's
            # creation: make it again. (Once the temp is in it, it is not empty any more.)
            os.close(dfd)
            if attempt == RACE_ATTEMPTS - 1:
                raise
            continue
        except BaseException:
            os.close(dfd)
            raise
        return dfd, name, fd
    raise AssertionError("unreachable")


def _unlink_quietly(dfd: int, name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dfd)


def _clean_temps_below(fd: int, now_ns: int, top: bool = True) -> None:
    """Remove the temp files crashed writers left below the namespace directory ``fd`` (closed
    after): only those no live writer holds (:func:`_new_temp`) and at least :data:`TEMP_GRACE_NS`
    away from ``now_ns`` (the store's clock: :func:`_clock_in`), older or dated ahead (a put gives
    its temp the source's mtime; only a temp made this instant is spared for its age). A directory below that holds
    ``.sidecar`` or ``.sidecar-meta`` is never entered: it is a nested namespace, whose writers
    clean their own. No symlink is followed."""
    try:
        entries = list(os.scandir(fd))
        if not top and any(e.name in (OWN_NAMESPACE, META_DIR) for e in entries):
            return  # another namespace
        for e in entries:
            with contextlib.suppress(OSError, _Link):  # gone meanwhile, or a symlink: never followed
                if e.is_dir(follow_symlinks=False):
                    _clean_temps_below(_child_dir(fd, e.name, e.name), now_ns, top=False)
                elif e.name.startswith(TMP_PREFIX) and e.is_file(follow_symlinks=False):
                    _remove_if_dead(fd, e.name, now_ns)
    finally:
        os.close(fd)


def _remove_if_dead(dfd: int, name: str, now_ns: int) -> None:
    """Unlink the temp file ``name`` unless a live writer holds it or it is new (see
    :func:`_clean_temps_below`); checked and removed under its lock, never through a symlink.
    (Opened for writing, as a lock over NFS needs, but never written.)"""
    fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # its writer is alive
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and abs(now_ns - st.st_mtime_ns) >= TEMP_GRACE_NS:  # ahead: not new either
            os.unlink(name, dir_fd=dfd)
    finally:
        os.close(fd)


def _write_atomic(path: str, data: "bytes | Source", mode: int = 0o600, mtime_ns: int | None = None, *,
                  top: str) -> os.stat_result:
    """Write ``path`` via temp + fsync + rename + dir fsync, reaching its directory from ``top``
    without following a symlink; returns the file's final status."""
    *head, name = _rel_parts(path, top)
    dfd, tmp, fd = _temp_in(top, head)
    try:
        try:
            final = _fill(fd, data, mode, mtime_ns)
            if (st := _lstat_at(dfd, name)) is not None and stat.S_ISLNK(st.st_mode):
                raise _Link("/".join(head + [name]))  # rename would replace it: not ours to remove
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            _unlink_quietly(dfd, tmp)
            raise
        finally:
            os.close(fd)
        _fsync_dir(dfd)
        return final
    finally:
        os.close(dfd)


def _is_lock(name: str) -> bool:
    return name == OWN_LOCK or name.startswith(KEY_LOCK_PREFIX)


def _still_linked(dfd: int, name: str, fd: int) -> bool:
    """Whether the (locked) file ``fd`` is still the one called ``name`` in ``dfd``: a lock file
    removed with its emptied namespace (:func:`_drop_lock`) while a writer waited for it locks
    nothing any more, and the writer takes the lock again."""
    st, here = os.fstat(fd), _lstat_at(dfd, name)
    return here is not None and (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino)


def _drop_lock(dfd: int, name: str) -> bool:
    """Remove the lock file ``name`` in ``dfd`` under its lock, unless a writer holds it (False:
    the namespace is in use); never through a symlink."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return True
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if _still_linked(dfd, name, fd):
            os.unlink(name, dir_fd=dfd)
        return True
    finally:
        os.close(fd)


def _key_order(entry: os.DirEntry) -> str:
    """Where ``entry``'s keys sort among its siblings' (by code point, as Azure and the memory
    store list): a directory's keys all begin with its name and ``/``."""
    return entry.name + "/" if entry.is_dir(follow_symlinks=False) else entry.name


def _lock_name(key: str) -> str:
    if key.startswith(OWN_PREFIX):
        return OWN_LOCK  # the same file as releases that lock only their own objects
    stripe = int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()[:4], "big")
    return f"{KEY_LOCK_PREFIX}{stripe % LOCK_STRIPES:02d}"


def _clock_at(dfd: int, close: bool = False) -> float:
    """The filesystem's clock: the change time of a temp file made (and removed) in the directory
    ``dfd`` (closed after, with ``close``), in seconds since the epoch (what the store's objects'
    ``modified`` is read on)."""
    try:
        return _clock_in(dfd) / 1e9
    finally:
        if close:
            os.close(dfd)


def _clock_in(dfd: int) -> int:
    """:func:`_clock_at` in nanoseconds: the probe is a temp file like a put's (locked while it
    lives, so no other writer's clean-up removes it under it)."""
    name, fd = _new_temp(dfd)
    try:
        return os.fstat(fd).st_ctime_ns
    finally:
        _unlink_quietly(dfd, name)  # (while still locked)
        os.close(fd)


def device_of(path: str) -> int | None:
    """The filesystem of ``path``, or of its nearest existing parent (a root may not exist yet)."""
    while True:
        try:
            return os.stat(path).st_dev
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
        except OSError:
            return None
