"""What the store is known to hold: the one owner of that belief. In memory only, no I/O.

Built from the start-up listing (:meth:`StoreState.from_listing`), then kept current by our own
writes (:meth:`~StoreState.stored`, :meth:`~StoreState.deleted`) and, now and then, replaced by a
fresh full listing (:meth:`~StoreState.replace`). Besides the objects it holds:

* the directories that held a known key, so a hint for a vanished path is recognised as a
  directory cheaply (never pruned: a stale entry costs one scan);
* the files not mirrored (too large, unreadable, older than stored), with the signature of the
  version that was skipped: reconciles leave them alone until they change;
* the snapshot roots whose bundle may still be in the store (see :mod:`sidecar.snapshot`): the
  next commit of such a root replaces its bundle, and the start-up cleanup deletes it.

The uploader, the watcher's hints and the daemon's reconcile read and update it; nothing else
holds a copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol

from sidecar.store.base import ObjectInfo

if TYPE_CHECKING:
    from sidecar.localfs import LocalStat


class Listing(Protocol):
    """What :meth:`StoreState.from_listing` reads of a listing (:class:`sidecar.listing.Listing`,
    which sits above this module and is not imported here)."""

    objects: dict[str, ObjectInfo]
    bundles: set[str]
    stale: dict[str, ObjectInfo]


#: What a skipped file looked like when it was skipped: (size, mtime_ns, ctime_ns).
Signature = tuple[int, int, int]


class StoreState:
    def __init__(self, objects: dict[str, ObjectInfo] | None = None, bundles: Iterable[str] = ()) -> None:
        """``objects`` is taken over, not copied (a listing can be large)."""
        self._objects: dict[str, ObjectInfo] = {} if objects is None else objects
        self._dirs: set[str] = set()
        self._skipped: dict[str, Signature] = {}
        self._bundles: set[str] = set(bundles)
        self.note_dirs(self._objects)

    @classmethod
    def from_listing(cls, listing: Listing, snapshot_roots: Iterable[str]) -> StoreState:
        """What a listing says the store holds; of its bundles, those of ``snapshot_roots`` count
        (another root's bundle is not ours to replace or delete). Takes over the listing's objects;
        its stale ones (a file and a directory of one name, the older not restored) are held too,
        so that a reconcile deletes them."""
        state = cls(listing.objects, listing.bundles & set(snapshot_roots))
        for key, info in listing.stale.items():
            state.stored(key, info)
        return state

    # -- objects ---------------------------------------------------------------------------
    def get(self, key: str) -> ObjectInfo | None:
        return self._objects.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._objects

    def stored(self, key: str, info: ObjectInfo) -> None:
        """``key`` now holds ``info`` in the store (a write of ours succeeded)."""
        self._objects[key] = info
        self.note_dirs((key,))

    def deleted(self, key: str) -> None:
        """``key`` is not in the store (a delete of ours succeeded)."""
        self._objects.pop(key, None)

    def replaced_by(self, key: str) -> list[str]:
        """The known objects a file at ``key`` replaces: a file stored at one of its parent paths
        (``r/a`` for ``r/a/x``) and, if ``key`` was a directory, every object below it."""
        out = []
        d = key.rpartition("/")[0]
        while "/" in d:  # below the root's own name
            if d in self._objects:
                out.append(d)
            d = d.rpartition("/")[0]
        if key in self._dirs:
            out += self.keys_below(key + "/")
        return out

    def keys(self) -> set[str]:
        """The known keys (a copy: safe to keep while the state changes)."""
        return set(self._objects)

    def keys_below(self, prefix: str) -> list[str]:
        """The known keys that start with ``prefix`` (a directory's: end it with ``/``)."""
        return [k for k in self._objects if k.startswith(prefix)]

    def objects_in(self, root_names: set[str]) -> dict[str, ObjectInfo]:
        """The known objects of the roots named ``root_names`` (a copy)."""
        return {k: v for k, v in self._objects.items() if k.split("/", 1)[0] in root_names}

    def replace(self, root_names: set[str], listed: dict[str, ObjectInfo], busy: set[str]) -> None:
        """A fresh full listing of the roots named ``root_names`` (``listed``: its objects of those
        roots) replaces what was believed of them, except for ``busy`` keys: an operation pending or
        running on one of them will record its own outcome, which the listing may predate."""
        for k in [k for k in self._objects if k.split("/", 1)[0] in root_names and k not in busy]:
            del self._objects[k]
        self._objects.update({k: v for k, v in listed.items() if k not in busy})
        self.note_dirs(listed)

    # -- directories -----------------------------------------------------------------------
    def has_dir(self, path: str) -> bool:
        """Whether a known key ever lay below the directory key ``path``."""
        return path in self._dirs

    def note_dirs(self, keys: Iterable[str]) -> None:
        """Remember the directories of ``keys`` (so a vanished directory is recognised cheaply)."""
        dirs = self._dirs
        for key in keys:
            d = key.rpartition("/")[0]
            while d and d not in dirs:
                dirs.add(d)
                d = d.rpartition("/")[0]

    # -- skipped files ---------------------------------------------------------------------
    def skip(self, key: str, sig: Signature) -> bool:
        """Record that the version ``sig`` of ``key`` is not mirrored; False when that very version
        was recorded already (counted and logged then)."""
        if self._skipped.get(key) == sig:
            return False
        self._skipped[key] = sig
        return True

    def unskip(self, key: str) -> None:
        """``key`` was read for upload: the version skipped of it is not what is on disk."""
        self._skipped.pop(key, None)

    def still_skipped(self, key: str, st: LocalStat) -> bool:
        """True when ``key`` was skipped and its file (``st``, from a scan) has not changed since."""
        return self.skipped_version(key, (st.size, st.mtime_ns, st.ctime_ns))

    def skipped_keys(self) -> set[str]:
        """The keys whose version on disk is not mirrored (a copy)."""
        return set(self._skipped)

    def skipped_version(self, key: str, sig: Signature) -> bool:
        """True when the version ``sig`` of ``key`` is the one skipped."""
        return self._skipped.get(key) == sig

    # -- snapshot bundles ------------------------------------------------------------------
    def add_bundle(self, root_name: str) -> None:
        """The root's bundle may be in the store (put, or found by a listing)."""
        self._bundles.add(root_name)

    def discard_bundle(self, root_name: str) -> None:
        """The root's bundle is deleted."""
        self._bundles.discard(root_name)

    def has_bundle(self, root_name: str) -> bool:
        """Whether the root's bundle may still be in the store."""
        return root_name in self._bundles

    def bundles(self) -> set[str]:
        """The roots whose bundle may still be in the store (a copy)."""
        return set(self._bundles)
