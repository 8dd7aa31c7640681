"""Pure path logic: mapping local files to store keys and back, and refusing hostile names.

A *key* is what the store holds, relative to the store's prefix: ``<root name>/<relative path>``
with ``/`` separators, e.g. ``.checkpoints/alice/resp_1/3f2a.json``. Every key that comes back
from a store is untrusted input and goes through :func:`split_key` before it touches a disk.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass


class UnsafeKey(ValueError):
    """A stored name that would land outside its root, or is not a plain relative path."""


#: Names the sidecar itself uses inside a store; no root may be called like this.
RESERVED_NAMES = frozenset({".sidecar-meta", ".sidecar"})

#: Basename patterns never mirrored: the writers' temp files and our own restore temp files.
DEFAULT_IGNORE = ("*.tmp", ".sidecar-*")

#: A restore's temp files (``<prefix><random>`` beside their target).
RESTORE_TMP_PREFIX = ".sidecar-restore-"
#: Left at the top of a root while a restore fills it; still there at start-up, it says that the
#: root holds a cut-short restore, not the truth.
RESTORE_MARKER = ".sidecar-restoring"
#: At the top of a root: the stored keys of that root its restores refused or set aside (never
#: placed on disk, so never to be taken for deleted), kept across the sidecar's restarts.
KEPT_FILE = ".sidecar-kept"
#: At the top of a root: which store and namespace filled or mirrored it. Only a root that carries
#: this namespace's record is the truth (see :func:`sidecar.restore.plan.decide_restore`).
LINEAGE_FILE = ".sidecar-lineage"
#: Our own files inside roots: never mirrored, whatever ``ignore`` says.
INTERNAL_IGNORE = (RESTORE_TMP_PREFIX + "*", RESTORE_MARKER, KEPT_FILE, LINEAGE_FILE)

MAX_KEY_BYTES = 1024  # Azure Blob's limit on a blob name; the directory store follows it too.
PATH_MAX, NAME_MAX = 4096, 255  # bytes: a whole path, one component (Linux)


def check_local_path(path: str, what: str) -> None:
    """ValueError, one line naming ``what``, when ``path`` cannot be a path on this machine: a NUL,
    more than PATH_MAX bytes, a component of more than NAME_MAX (``~`` expanded first)."""
    if "\x00" in path:
        raise ValueError(f"{what} path must not contain NUL")
    raw = os.path.expanduser(path).encode("utf-8", "surrogateescape")
    if len(raw) >= PATH_MAX:
        raise ValueError(f"{what} path is longer than {PATH_MAX - 1} bytes")
    if any(len(part) > NAME_MAX for part in raw.split(b"/")):
        raise ValueError(f"{what} path has a component longer than {NAME_MAX} bytes")

_INTERNAL = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in INTERNAL_IGNORE)).match


@dataclass(frozen=True)
class Root:
    """A mirrored tree: ``path`` on disk, kept under ``name`` in the store."""

    name: str
    path: str  # absolute, normalised, not resolved through symlinks


def root_name_for(path: str) -> str:
    name = os.path.basename(os.path.normpath(path))
    if not name or name in (".", "..", "/"):
        raise ValueError(f"cannot mirror {path!r}: a root needs a directory name of its own")
    if name in RESERVED_NAMES:
        raise ValueError(f"cannot mirror {path!r}: the name {name!r} is reserved by the sidecar")
    return name


def make_roots(paths: list[str], cwd: str) -> list[Root]:
    """Absolute roots from configured paths; refuses duplicates, nesting and name clashes."""
    roots: list[Root] = []
    for p in paths:
        absolute = os.path.normpath(os.path.join(cwd, os.path.expanduser(p)))
        roots.append(Root(root_name_for(absolute), absolute))
    names: dict[str, str] = {}
    for r in roots:
        if r.name in names:
            raise ValueError(
                f"roots {names[r.name]!r} and {r.path!r} share the name {r.name!r}; "
                "each root is stored under its directory name, so they would collide"
            )
        names[r.name] = r.path
    for a in roots:
        for b in roots:
            if a is not b and is_within(b.path, a.path):
                raise ValueError(f"root {b.path!r} lies inside root {a.path!r}")
    real = {r.path: os.path.realpath(r.path) for r in roots}  # the directories the names lead to
    for a in roots:
        for b in roots:
            if a is not b and is_within(real[b.path], real[a.path]):
                same = "is the same directory as" if real[a.path] == real[b.path] else "lies inside"
                raise ValueError(f"root {b.path!r} {same} root {a.path!r} through a symbolic link "
                                 f"({real[b.path]!r}): it would be mirrored twice; configure one of them")
    return roots


def is_within(path: str, parent: str) -> bool:
    path, parent = os.path.normpath(path), os.path.normpath(parent)
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def validate_relpath(rel: str) -> list[str]:
    """The ``/``-separated components of a relative path, or :class:`UnsafeKey`."""
    if not rel:
        raise UnsafeKey("empty name")
    if "\x00" in rel:
        raise UnsafeKey(f"name contains NUL: {rel!r}")
    if "\\" in rel:
        raise UnsafeKey(f"name contains a backslash: {rel!r}")
    if rel.startswith("/"):
        raise UnsafeKey(f"name is absolute: {rel!r}")
    if len(rel.encode("utf-8", "surrogateescape")) > MAX_KEY_BYTES:
        raise UnsafeKey(f"name longer than {MAX_KEY_BYTES} bytes: {rel[:60]!r}...")
    parts = rel.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise UnsafeKey(f"name has an empty, '.' or '..' component: {rel!r}")
    return parts


def _check_reserved(parts: list[str], key: str) -> None:
    """:class:`UnsafeKey` when a component below the root is one of :data:`RESERVED_NAMES`: a
    root named like a nested namespace must never read, write or delete that namespace's own
    records (its owner marker, the directory store's metadata)."""
    if any(part in RESERVED_NAMES for part in parts):
        raise UnsafeKey(f"name has a component reserved by the sidecar (.sidecar, .sidecar-meta): {key!r}")


def make_key(root: Root, rel: str) -> str:
    _check_reserved(validate_relpath(rel), rel)
    return f"{root.name}/{rel}"


def split_key(key: str, roots_by_name: dict[str, Root]) -> tuple[Root, list[str]]:
    """Which root a stored key belongs to and its safe path components under that root.

    Raises :class:`UnsafeKey` for any key that is not a plain relative path of a configured root,
    and for a name of the sidecar's own files in roots (:data:`INTERNAL_IGNORE`: its control files,
    restore temp files): no upload ever stores one (they are ignored at every depth), and placed on
    a disk it would pass for the sidecar's own record. A component named like the store's own
    records (:data:`RESERVED_NAMES`, at any depth) is refused too: never restored, uploaded or deleted.
    """
    parts = validate_relpath(key)
    if len(parts) < 2:
        raise UnsafeKey(f"name has no path below a root: {key!r}")
    if _INTERNAL(parts[-1]):
        raise UnsafeKey(f"name is one of the sidecar's own files in roots: {key!r}")
    _check_reserved(parts[1:], key)
    root = roots_by_name.get(parts[0])
    if root is None:
        raise UnsafeKey(f"name belongs to no configured root: {key!r}")
    return root, parts[1:]


def locate(path: str, roots: list[Root]) -> tuple[Root, str] | None:
    """The root a local absolute path lies under and its relative ``/`` path, or None.

    The root directory itself maps to ``(root, "")``.
    """
    path = os.path.normpath(path)
    for root in roots:
        if path == root.path:
            return root, ""
        if path.startswith(root.path.rstrip("/") + "/"):
            return root, path[len(root.path.rstrip("/")) + 1 :]
    return None


class IgnoreRules:
    """Basename glob patterns (``fnmatch``) for files that are never mirrored."""

    def __init__(self, patterns: tuple[str, ...] | list[str] = DEFAULT_IGNORE) -> None:
        self.patterns = tuple(patterns)
        every = (*self.patterns, *INTERNAL_IGNORE)
        self._match = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in every)).match

    def ignored(self, rel: str) -> bool:
        return self._match(rel.rsplit("/", 1)[-1]) is not None
