"""The per-root ledger of a running sidecar: what each root is known to be, and so what of it must
never be deleted.

One :class:`RootLedger` per daemon owns, per root: its directory as last found intact, whether it
is gone as a whole or reported itself since its last scan, whether its stored files are kept
(empty and not restored, cut short, not this namespace's disk), whether its lineage record is due,
what its last scan could not see; and the stored keys kept for the whole namespace (refused or set
aside by a restore, or lacked by a disk that came back unproven), persisted in each root's
``.sidecar-kept``. Others read it or call its methods; the rules themselves are pure
(:func:`~sidecar.plan.plan_root_presence`, :func:`~sidecar.plan.plan_root_keep`).
"""

from __future__ import annotations

from typing import Awaitable, Callable, Iterable

import anyio
import anyio.to_thread

from sidecar import log
from sidecar.health import Health
from sidecar.localfs import Gaps, LocalStat, root_identity
from sidecar.paths import Root
from sidecar.plan import Protected, RootKeep, RootPresence, plan_root_presence
from sidecar.restorefs import lineage_recorded, load_kept, save_kept


class RootLedger:
    """The roots' state (see the module docstring). ``ours``: whether a root's lineage record says
    this namespace's disk (the daemon's lineage, which changes at the claim)."""

    def __init__(self, roots: list[Root], health: Health, ours: Callable[[Root], Awaitable[bool]]) -> None:
        self.roots = roots
        self.health = health
        self._ours = ours
        #: roots that were empty at start and not restored: their stored copy must not be deleted
        self.empty_roots: set[str] = set()
        #: stored keys never deleted: refused or quarantined by the restore (never placed on disk),
        #: or lacked by a root back without this namespace's record
        self.kept_keys: set[str] = set()
        #: what the last scan of each root could not see or cannot store
        self.gaps: dict[str, Gaps] = {}
        #: roots still holding a cut-short restore (not restored again, e.g. ``--no-restore``): a
        #: fragment of the stored state, so their stored files are never deleted
        self.incomplete: set[str] = set()
        #: roots that are this namespace's but did not exist at the restore: recorded before their
        #: first upload is queued
        self.lineage_due: set[str] = set()
        #: roots with neither this namespace's record nor a restore that filled them (not restored:
        #: ``--no-restore``, or an unreachable store with SIDECAR_RESTORE_OPTIONAL): the disk is not
        #: the truth, so their stored files are never deleted
        self.unproven: set[str] = set()
        #: each root's directory (st_dev, st_ino) as the last scan that found it intact saw it (or
        #: as it was when mirroring began): a root with another identity was replaced as a whole
        self.root_ids: dict[str, tuple[int, int]] = {}
        #: roots gone as a whole while the store holds their files (name -> why): nothing stored
        #: of them is deleted, and the sidecar is not ready (see sidecar.plan.plan_root_presence)
        self.gone: dict[str, str] = {}
        #: roots the watcher reported themselves (removed, replaced, their attributes changed)
        #: since their last scan, each with a count: their deletes wait for that scan
        self.reported: dict[str, int] = {}
        #: roots this disk has not had since the restore found nothing stored of them, vouched by
        #: the take-over check: while still absent, they hold no files (their deletes may go)
        self.never_there: set[str] = set()

    # -- what must not be deleted -------------------------------------------------------------
    @property
    def kept_roots(self) -> set[str]:
        """Roots whose stored files are never deleted: empty and not restored, cut short, or a disk
        this namespace is not known to hold."""
        return self.empty_roots | self.incomplete | self.unproven

    def protected(self, gaps: Gaps | None = None, hidden: set[str] = frozenset()) -> Protected:  # type: ignore[assignment]
        """What a reconcile must not delete now: the kept roots, the roots its scan did not find
        intact (``hidden``), the kept keys, and ``gaps`` (what its scan could not see)."""
        return Protected(frozenset(self.kept_roots | hidden), frozenset(self.kept_keys), gaps)

    def root_intact(self, root: Root) -> bool:
        """Whether a file missing in ``root`` now means the host deleted it: the root is the very
        directory the last scan found intact, not gone, replaced or reported since. Asked by the
        hints and right before each delete is sent (from worker threads too: reads and a stat)."""
        if root.name in self.never_there:
            return root_identity(root.path) is None
        last = self.root_ids.get(root.name)
        return (last is not None and root.name not in self.gone and root.name not in self.reported
                and root_identity(root.path) == last)

    # -- start-up -----------------------------------------------------------------------------
    async def begin(self) -> None:
        """The directories mirroring begins with, before anything is watched."""
        for root in self.roots:
            ident = await anyio.to_thread.run_sync(root_identity, root.path)
            if ident is not None:
                self.root_ids[root.name] = ident

    async def keep(self, refused: set[str]) -> None:
        """Add the keys this start's restore refused or set aside to those earlier starts recorded
        on this disk (``KEPT_FILE`` in each root), and record the union: a restarted sidecar beside
        the same disk must not take their absence for a deletion either."""
        for root in self.roots:
            earlier = await anyio.to_thread.run_sync(load_kept, root)
            now = {k for k in refused if k.startswith(root.name + "/")}
            self.kept_keys |= earlier | now
            if now - earlier:
                await anyio.to_thread.run_sync(save_kept, root, earlier | now)

    async def forget_kept(self, present: set[str]) -> None:
        """Keys with a file of the host's own on disk again are mirrored as usual from now on."""
        gone = self.kept_keys & present
        if not gone:
            return
        self.kept_keys -= gone
        for root in self.roots:
            if any(k.startswith(root.name + "/") for k in gone):
                await anyio.to_thread.run_sync(save_kept, root, self.kept_keys)

    # -- lineage records due ------------------------------------------------------------------
    def due(self, names: Iterable[str]) -> None:
        """Roots whose lineage record is to be written before their first upload is queued."""
        self.lineage_due |= set(names)

    def recorded(self, name: str) -> None:
        """A due root's record was written (or cannot be: logged, tried again next reconcile)."""
        self.lineage_due.discard(name)

    # -- what the watcher and the scans found -------------------------------------------------
    def note_reported(self, paths: list[str]) -> None:
        """A root reported itself (removed, replaced) deletes nothing until it is scanned again: the
        watcher rebuilds the watch and rescans it next. Its files' deletions in the same batch
        (rm -rf) are not the host deleting files one by one."""
        for root in self.roots:
            if root.path in paths:
                self.reported[root.name] = self.reported.get(root.name, 0) + 1

    async def presence(self, root: Root, now: tuple[int, int] | None, files: dict[str, LocalStat], gaps: Gaps,
                       stored: Iterable[str], *, restored: bool, reports: int | None) -> bool:
        """Apply :func:`~sidecar.plan.plan_root_presence` to a scanned root (``now``: its identity,
        the same before and after the scan, else None); True when it is intact. A root gone as a whole
        is said once and makes the sidecar unready; one back without this namespace's lineage record
        (recreated by the host, another volume) keeps the stored files it lacks (``.sidecar-kept``),
        one back with it (a remount of the same disk) is compared as usual."""
        name = root.name
        if now is not None:
            self.never_there.discard(name)  # it exists now: the rules of a root that is there apply
        if name in gaps.unreadable:
            return False  # an unreadable root: said and kept by the gaps' rule, identity unknown
        stored = set(stored)
        last = self.root_ids.get(name)
        # reported itself and its record gone: removed and made again at once (the inode reused)
        replaced = last is not None and now is not None and (now != last or (
            reports is not None and name not in self.unproven and not lineage_recorded(root)))
        presence: RootPresence = plan_root_presence(
            present=now is not None, replaced=replaced, was_gone=name in self.gone, stored=bool(stored),
            seen=last is not None or restored, has_files=bool(files))
        if presence.gone is not None:
            if name not in self.gone:
                log.warning("root_gone", root=root.path, stored=len(stored), why=presence.gone,
                            detail="the root went as a whole (removed, replaced, a mount gone): taken for unreadable, "
                                   "not for deleted; its stored files are kept and mirroring resumes when it is back")
            self.gone[name] = presence.gone
            self.health.root_gone(name, f"the root {log.printable(root.path)} is gone ({presence.gone}): its "
                                        f"{len(stored)} stored files are kept; mirroring resumes when it is back")
        elif name in self.gone:  # nothing of it is stored any more: nothing left to keep
            self.gone.pop(name)
            self.health.root_gone(name, None)
        if not presence.intact:
            return False
        if presence.returned:
            kept = sorted(stored - files.keys() - self.kept_keys)
            held = await self._ours(root)
            if held:
                kept = []  # the same disk is back (a remount): it is the truth, compared as usual
            elif kept:
                self.kept_keys |= set(kept)
                await anyio.to_thread.run_sync(save_kept, root, self.kept_keys)
            (log.info if held else log.warning)(
                "root_returned", root=root.path, files=len(files), kept=len(kept),
                detail="this namespace's disk again: compared with the store as usual" if held else
                "not this namespace's disk (no lineage record): the stored files it lacks are kept, never deleted "
                "for their absence, until the host writes them again")
        if self.gone.pop(name, None) is not None:
            self.health.root_gone(name, None)
        assert now is not None  # intact: present
        self.root_ids[name] = now
        if reports is not None and self.reported.get(name) == reports:
            del self.reported[name]  # a report that came during the scan waits for the next one
        return True

    def keep_root(self, root: Root, has_files: bool, keep: RootKeep) -> None:
        """Apply :func:`~sidecar.plan.plan_root_keep` to the roots whose stored files are kept
        (saying once why) and to those whose lineage is due."""
        if keep.empty:
            self.empty_roots.add(root.name)
        elif keep.empty is False:
            self.empty_roots.discard(root.name)
        if keep.unproven:
            self.unproven.add(root.name)
            if has_files:
                log.warning("root_unproven_protected", root=root.path,
                            detail="this disk holds no record that this namespace filled it and it was not restored: "
                                   "its stored files are kept (never deleted); a restore merges them in")
        if keep.due:
            self.lineage_due.add(root.name)  # the host removed the root, and the record with it
        if keep.incomplete:
            self.incomplete.add(root.name)
            log.warning("restore_incomplete_root_protected", root=root.path,
                        detail="an earlier restore into this root was cut short and it was not restored again; "
                               "its stored files are kept (never deleted) until a restore completes")

    def note_gaps(self, root: Root, gaps: Gaps) -> None:
        """Say once what a scan cannot see or store (and when it can again); a root that cannot
        be read makes the sidecar unready: nothing of it would be mirrored."""
        seen = self.gaps.get(root.name, Gaps())
        for d, why in gaps.unreadable.items():
            if d not in seen.unreadable:
                log.error("directory_unreadable", path=d, error=why,
                          detail="its stored files are kept, and nothing below it is mirrored until it can be read "
                                 "(run the sidecar as the host's user, or fix the permissions)")
        for d in seen.unreadable.keys() - gaps.unreadable.keys():
            log.info("directory_readable_again", path=d)
        for key in set(gaps.unstorable) - set(seen.unstorable):
            log.error("file_unstorable", path=key, detail="its path is longer than a store name may be: never mirrored")
        self.gaps[root.name] = gaps
        self.health.root_readable(root.name, f"cannot read {root.path}: {gaps.unreadable[root.name]}"
                                  if root.name in gaps.unreadable else None)
