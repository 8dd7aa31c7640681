"""The directory store's upkeep of its namespace's layout (:class:`Layout`, a part of
:class:`~sidecar.store.directory.DirectoryStore`): its directories opened without following a
symlink, a key's way cleared of stale objects, the keys' lock files taken and dropped with the
namespace's last object, empty directories pruned, and dead writers' temp files removed. The rules
are told in :mod:`sidecar.store.directory`'s docstring."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from contextlib import contextmanager, suppress
from typing import Iterator

from sidecar.store.base import StoreError
from sidecar.store.dirfs import (
    META_DIR,
    RACE_ATTEMPTS,
    _child_dir,
    _child_dir_if,
    _clean_temps_below,
    _clock_in,
    _drop_lock,
    _files_below,
    _fsync_dir,
    _is_lock,
    _Link,
    _lock_name,
    _lstat_at,
    _meta_name,
    _meta_path,
    _open_dir,
    _remove_durably,
    _rmtree_at,
    _still_linked,
    _unlink_durably,
)


class Layout:
    """The namespace ``<base>/<prefix>``'s directories, lock files and leftovers. Blocking: called
    in worker threads only."""

    base: str
    top: str
    _prefix_parts: list[str]
    _bad_prefix: str
    _temps_cleaned: bool

    def _ns(self, create: bool = False) -> int:
        """A descriptor of the namespace's directory (``<base>/<prefix>``), never through a
        symlink below the base."""
        return self._dir([], create)

    def _dir(self, parts: list[str], create: bool = False) -> int:
        if self._bad_prefix:
            raise StoreError(f"directory store {self.base}: refusing the prefix: {self._bad_prefix}")
        return _open_dir(self.base, self._prefix_parts + parts, create)

    def _where(self, parts: list[str]) -> str:
        return "/".join(self._prefix_parts + parts)


    @contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        """An exclusive ``flock`` of ``key``'s lock file for the block, so that two writers'
        check-then-replace of one key never interleave (two sidecars claiming the owner marker at
        once would otherwise both pass the stamp check, and an older put finishing last would
        replace a newer one). Across hosts this holds where the shared filesystem honours flock,
        as NFS does. A lock file removed with its emptied namespace while this waited for it
        (:meth:`_drop_locks`) is taken again, made anew. Blocking: called in a worker thread only."""
        name = _lock_name(key)
        for _attempt in range(RACE_ATTEMPTS):
            if (fd := self._lock_once(name)) is not None:
                try:
                    yield
                finally:
                    os.close(fd)  # releases the lock
                return
        raise StoreError(f"directory store {self.top}: the lock file {self._where([META_DIR, name])!r} "
                         "kept being removed while it was taken; try again")

    def _lock_once(self, name: str) -> int | None:
        """The lock file ``name``, made if missing and locked, or None when it (or its directory)
        was removed meanwhile."""
        dfd = self._dir([META_DIR], create=True)
        try:
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600,
                             dir_fd=dfd)
            except FileNotFoundError:
                return None  # the records' directory went with its emptied namespace
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise _Link(self._where([META_DIR, name])) from None
                raise
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise StoreError(f"directory store {self.base}: the lock file "
                                     f"{self._where([META_DIR, name])!r} is not a regular file; remove it")
                fcntl.flock(fd, fcntl.LOCK_EX)
                if _still_linked(dfd, name, fd):
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            return None
        finally:
            os.close(dfd)

    def _drop_locks(self) -> None:
        """Once the namespace holds no object (its last one deleted: a prune, a namespace's
        deletion), its lock files go with it, then its records' directory and its own (never the
        base): each lock file only while no writer holds it, a directory only while empty, so a
        writer arriving meanwhile keeps what it needs (or makes it again)."""
        try:
            fd = self._ns()
        except (OSError, _Link):
            return
        try:
            if [e.name for e in os.scandir(fd)] != [META_DIR]:
                return
            mfd = _child_dir(fd, META_DIR, self._where([META_DIR]))
            try:
                names = os.listdir(mfd)
                if not all(_is_lock(n) for n in names) or not all(_drop_lock(mfd, n) for n in names):
                    return  # a record or a temp file (not empty), or a writer at work
                _fsync_dir(mfd)
            finally:
                os.close(mfd)
            os.rmdir(META_DIR, dir_fd=fd)
            _fsync_dir(fd)
        except (OSError, _Link):
            return
        finally:
            os.close(fd)
        if self._prefix_parts:  # the namespace's own directory, while still empty (never the base)
            with suppress(OSError, _Link):
                pfd = _open_dir(self.base, self._prefix_parts[:-1], False)
                try:
                    os.rmdir(self._prefix_parts[-1], dir_fd=pfd)
                    _fsync_dir(pfd)
                finally:
                    os.close(pfd)

    def _has_record(self, rel: str) -> bool:
        *head, name = rel.split("/")
        try:
            rfd = self._dir([META_DIR, *head])
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            st = _lstat_at(rfd, _meta_name(name))
            return st is not None and stat.S_ISREG(st.st_mode)
        finally:
            os.close(rfd)

    def _clear_way(self, parts: list[str]) -> None:
        """Make sure nothing on the way to the key ``parts`` is a symlink (:class:`_Link`), and
        that no stale object stands in it: a file where a directory goes, or a directory of
        objects where a file goes (removed with their records). What a concurrent delete removes
        meanwhile (the directories it empties) is out of the way: the put makes them again."""
        try:
            fd = self._ns()
        except FileNotFoundError:
            return
        try:
            for i, part in enumerate(parts):
                rel = "/".join(parts[:i + 1])
                st = _lstat_at(fd, part)
                if st is None:
                    return
                last = i == len(parts) - 1
                if stat.S_ISLNK(st.st_mode):
                    raise _Link(self._where(parts[:i + 1]))
                if not last and stat.S_ISREG(st.st_mode):  # an object "a" where "a/b" must go
                    self._check_objects(rel, [rel])
                    if _unlink_durably(fd, part):  # (else a concurrent delete removed it and its record)
                        _remove_durably(_meta_path(self.top, rel), self.base)
                    return
                if last and stat.S_ISDIR(st.st_mode):  # objects "a/..." where "a" must go
                    if (sub := _child_dir_if(fd, part, self._where(parts))) is None:
                        return
                    try:
                        below = _files_below(sub, parts, self._where)
                    finally:
                        os.close(sub)
                    self._check_objects(rel, below)
                    _rmtree_at(fd, part)
                    self._remove_record_tree(parts)
                    _fsync_dir(fd)
                    return
                if last or not stat.S_ISDIR(st.st_mode):
                    return  # (something else in the way: the open that follows names it)
                if (nfd := _child_dir_if(fd, part, self._where(parts[:i + 1]))) is None:
                    return
                os.close(fd)
                fd = nfd
        finally:
            os.close(fd)

    def _remove_record_tree(self, parts: list[str]) -> None:
        """Remove the records' directory of the (removed) directory of objects ``parts``."""
        try:
            rfd = self._dir([META_DIR, *parts[:-1]])
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            st = _lstat_at(rfd, parts[-1])
            if st is None:
                return
            if stat.S_ISLNK(st.st_mode):
                raise _Link(self._where([META_DIR, *parts]))
            if stat.S_ISDIR(st.st_mode):
                if (sub := _child_dir_if(rfd, parts[-1], self._where([META_DIR, *parts]))) is None:
                    return  # (pruned by a concurrent delete of its last records)
                try:
                    _files_below(sub, [META_DIR, *parts], self._where)  # refuses a symlink among them
                finally:
                    os.close(sub)
                _rmtree_at(rfd, parts[-1])
                _fsync_dir(rfd)
        finally:
            os.close(rfd)

    def _check_objects(self, where: str, keys: list[str]) -> None:
        """Only stored objects (with their records) may be replaced: anything else in the way is
        not ours to remove. One a concurrent delete removed meanwhile is not in the way, nor a
        directory (of other keys) a put made in its place since."""
        for key in keys:
            if not self._has_record(key) and not self._gone(key.split("/")):
                raise StoreError(f"directory store {self.top}: {where!r} is in the way "
                                 "and is not a stored object (something else wrote it); remove it")

    def _gone(self, parts: list[str]) -> bool:
        """Whether no object stands at ``parts`` now (nothing, or a directory of other keys)."""
        if (found := self._target(parts, data=True)) is None:
            return True
        os.close(found[0])
        return False

    def _clean_temps(self) -> None:
        """Remove the temp files crashed writers left in this namespace (once, before this writer's
        first put): never a live writer's, nor a nested namespace's (:func:`_clean_temps_below`)."""
        with suppress(FileNotFoundError, NotADirectoryError):
            fd = self._ns()
            try:
                now_ns = _clock_in(fd)
            except BaseException:
                os.close(fd)
                raise
            _clean_temps_below(fd, now_ns)
        self._temps_cleaned = True


    def _target(self, parts: list[str], data: bool) -> tuple[int, str] | None:
        """The open directory and name of the file ``parts`` (below the namespace) to remove, or
        None when it is not there (for data: a directory of other keys standing there means this
        object is gone); :class:`_Link` when a symlink is on its way or in its place."""
        try:
            dfd = self._dir(parts[:-1])
        except (FileNotFoundError, NotADirectoryError):
            return None
        st = _lstat_at(dfd, parts[-1])
        if st is not None and stat.S_ISLNK(st.st_mode):
            os.close(dfd)
            raise _Link(self._where(parts))
        if st is None or (data and stat.S_ISDIR(st.st_mode)):
            os.close(dfd)
            return None
        return dfd, parts[-1]

    def _prune(self, dirs: list[str], keep: int = 0) -> bool:
        """Remove the directories ``dirs`` (below the namespace) left empty, deepest first, but
        never the first ``keep`` of them; whether all were."""
        for depth in range(len(dirs), keep, -1):
            try:
                pfd = self._dir(dirs[:depth - 1])
            except (OSError, _Link):
                return False
            try:
                os.rmdir(dirs[depth - 1], dir_fd=pfd)  # refuses a symlink (ENOTDIR) or a full one
            except OSError:
                return False
            finally:
                os.close(pfd)
        return True
