"""Path hints → intents: what the watcher's paths mean for the store, and what is never mirrored.

A hint says only that something happened at a path. It is resolved against the disk when it
arrives (a file: upload; a directory: upload every file below it; gone, a symlink or a special
file: delete) and against what the store is known to hold (:class:`~sidecar.known.StoreState`): a
vanished path that was a known directory deletes every key below it, and a file uploaded where
the store holds the other shape (a file at a parent path, objects below its own) deletes those. The intents go to the
pending work (:class:`Intents`, the uploader), which coalesces them and orders them safely.

What is not mirrored (an unmirrorable name, a symlink, a file too large or unreadable, one older
than the stored version) is counted and logged once per version, never silently.
"""

from __future__ import annotations

import os
import stat
from typing import Callable, Protocol

from sidecar import log, metrics
from sidecar.known import StoreState
from sidecar.localfs import absent, below_root_without_links, scan_root
from sidecar.paths import IgnoreRules, Root, UnsafeKey, locate, make_key
from sidecar.queue import DELETE, UPLOAD, Kind


class Intents(Protocol):
    """Where resolved hints go: the pending work."""

    def mark(self, key: str, kind: Kind) -> None: ...

    def is_pending(self, key: str) -> bool: ...

    def pending_keys(self) -> set[str]: ...


class Hints:
    def __init__(self, roots: list[Root], ignore: IgnoreRules, known: StoreState, intents: Intents,
                 intact: Callable[[Root], bool] = lambda root: True) -> None:
        self.roots = roots
        self.ignore = ignore
        self.known = known
        self.intents = intents
        #: whether a root is the directory being mirrored (not gone, not replaced): only then does
        #: a path missing in it mean that the host deleted a file (the daemon's rule)
        self.intact = intact
        self._warned = log.Once()

    def mark_paths(self, paths: list[str]) -> None:
        """Turn hints about absolute paths (from the watcher) into intents.

        A batch comes in no particular order (watchfiles hands over a set), so its deletions are
        queued after all of its uploads: "write B, then delete A" (or a renamed directory) must
        never have A gone from the store before B is in it. A root that is not intact (removed or
        replaced as a whole) deletes nothing: its next scan decides."""
        gone: list[str] = []
        replaced: list[str] = []
        for path in paths:
            self._mark_path(path, gone, replaced)
        intact: dict[str, bool] = {}
        by_name = {r.name: r for r in self.roots}

        def deletes_in(key: str) -> bool:
            name = key.partition("/")[0]
            if name not in intact:
                intact[name] = name in by_name and self.intact(by_name[name])
            return intact[name]

        for key in gone:
            if deletes_in(key):
                self._mark_gone(key)
        self._mark_replaced([k for k in replaced if deletes_in(k)])

    def _mark_replaced(self, keys: list[str]) -> None:
        """A file now lies where the store holds the other shape (a file ``a`` where ``a/x`` is
        uploaded, objects ``a/...`` where the file ``a`` is): the replaced objects are deleted with
        the change, behind the barrier (after the new upload is durable), not at the next rescan,
        unless a regular file is back at their path meanwhile."""
        by_name = {r.name: r for r in self.roots}
        for key in dict.fromkeys(keys):
            name, _, rel = key.partition("/")
            root = by_name.get(name)
            if root is not None and absent(root, rel):
                self.intents.mark(key, DELETE)

    def _mark_path(self, path: str, gone: list[str], replaced: list[str], resolved: bool = False) -> None:
        found = locate(path, self.roots)
        if found is None:
            return
        root, rel = found
        if rel and not resolved and not below_root_without_links(root, rel):
            # Reached through a symlinked directory. inotify watches inodes, so a symlink looping
            # back into a root makes events of real files arrive under the link's path: map the
            # real location back, and drop whatever really lies outside the roots.
            real = os.path.realpath(os.path.dirname(path))
            for r in self.roots:
                real_root = os.path.realpath(r.path)
                if real == real_root or real.startswith(real_root + "/"):
                    self._mark_path(os.path.join(r.path, os.path.relpath(real, real_root),
                                                 os.path.basename(path)), gone, replaced, resolved=True)
            return
        if not rel:
            return  # the root itself: handled by the watcher's root tracking
        if self.ignore.ignored(rel):
            return  # a writer's temp file, present or already renamed away
        try:
            key = make_key(root, rel)
        except UnsafeKey:
            self.warn_once("unmirrorable_name", rel)
            return
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            gone.append(key)
            return
        except OSError:
            return
        if stat.S_ISREG(st.st_mode):
            if self.known.skipped_version(key, (st.st_size, st.st_mtime_ns, st.st_ctime_ns)):
                return  # the very version skipped (an event that changed nothing): left alone
            self.intents.mark(key, UPLOAD)
            replaced += self.known.replaced_by(key)
        elif stat.S_ISDIR(st.st_mode):
            # a directory moved in brings files that produce no events of their own
            files, _ = scan_root(Root(key, path), self.ignore)  # keys come out as key/...
            for k in files:
                self.intents.mark(k, UPLOAD)
                replaced += self.known.replaced_by(k)
        else:  # a symlink or special file replaced what was there: never mirrored
            if stat.S_ISLNK(st.st_mode):
                self.warn_once("symlink_skipped", key)
            gone.append(key)

    def _mark_gone(self, key: str) -> None:
        if key in self.known or self.intents.is_pending(key):
            self.intents.mark(key, DELETE)
        elif self.known.has_dir(key):  # a directory deleted or moved away: everything below it
            prefix = key + "/"
            for k in self.known.keys_below(prefix) + [
                k for k in self.intents.pending_keys() if k.startswith(prefix)
            ]:
                self.intents.mark(k, DELETE)

    def skip(self, key: str, root: Root, parts: list[str], reason: str, detail: str) -> None:
        """Count and log a file that is not mirrored, once per version of it (a reconcile leaves
        that version alone: :meth:`StoreState.still_skipped`)."""
        try:
            st = os.lstat(os.path.join(root.path, *parts))
            sig: tuple[int, int, int] | None = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        except OSError:
            sig = None
        if sig is not None and not self.known.skip(key, sig):
            return  # the same file as last time: counted and logged already
        metrics.SKIPPED.labels(reason).inc()
        event = {"too_large": "file_too_large", "store_newer": "file_older_than_stored"}.get(reason, "file_unreadable")
        self.warn_once(event, f"{key} ({detail})")

    def warn_once(self, event: str, what: str) -> None:
        if self._warned.first((event, what)):
            log.warning(event, path=what)
