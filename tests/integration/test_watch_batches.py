"""What a batch of watcher events turns into, with real files and the real watcher.

watchfiles hands a batch over as a set: the order of its paths says nothing about the order of the
writes. Deletions must still never overtake the uploads of the same batch, and a watch rebuilt for
one root must not lose the events of the others.
"""

from __future__ import annotations

import os

import anyio
import pytest

import sidecar.watcher as watcher_mod
from sidecar.paths import IgnoreRules, make_roots
from sidecar.queue import DELETE, UPLOAD
from sidecar.store.base import ObjectInfo
from sidecar.uploader import Uploader
from support import write_atomic


@pytest.mark.parametrize("order", ["delete first", "upload first"])
def test_a_batchs_deletes_wait_for_its_uploads_whatever_the_order(tmp_path, order):
    """The host writes B, then deletes A; both arrive in one batch, in either order."""
    cps = tmp_path / ".checkpoints"
    roots = make_roots([str(cps)], str(tmp_path))
    uploader = Uploader(writer=None, roots=roots, ignore=IgnoreRules())
    a, b = ".checkpoints/ctx/A.json", ".checkpoints/ctx/B.json"
    uploader.known.stored(a, ObjectInfo(a, 1, "0" * 64, 1, 0o600))
    write_atomic(cps / "ctx" / "B.json", b"B")
    paths = [str(tmp_path / a), str(tmp_path / b)]
    uploader.mark_paths(paths if order == "delete first" else paths[::-1])
    first = uploader.pending.take()
    assert (first.kind, first.key) == (UPLOAD, b)
    assert uploader.pending.take() is None, "A's delete started while B was not stored yet"
    uploader.pending.done(first)
    second = uploader.pending.take()
    assert (second.kind, second.key) == (DELETE, a)


def test_a_watch_rebuilt_for_a_new_root_rescans_the_other_roots_too(tmp_path, monkeypatch):
    """A checkpoint written while the watch is rebuilt (``.function_approvals`` just appeared) has
    no event: no watch existed at that moment. The rescan after the rebuild must cover its root."""
    cps, approvals = tmp_path / ".checkpoints", tmp_path / ".function_approvals"
    cps.mkdir()
    roots = make_roots([str(cps), str(approvals)], str(tmp_path))
    real_notify = watcher_mod.RustNotify
    built = []

    def notify(*args):
        built.append(args)
        if len(built) == 2:  # the rebuild: the host writes between the old watch and the new one
            write_atomic(cps / "during-rebuild.json", b"x")
        return real_notify(*args)

    monkeypatch.setattr(watcher_mod, "RustNotify", notify)
    reported, rescanned = [], []

    async def on_paths(paths):
        reported.extend(os.path.basename(p) for p in paths)

    async def on_roots_changed(changed):
        rescanned.extend(r.name for r in changed)

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(watcher_mod.watch, roots, on_paths, on_roots_changed)
            approvals.mkdir()
            with anyio.fail_after(10):
                while not rescanned:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert len(built) == 2
    assert "during-rebuild.json" not in reported  # written while nothing watched: no event
    assert sorted(rescanned) == [".checkpoints", ".function_approvals"]


def _own_watches() -> int:
    """The inotify watches this process holds (``inotify wd:`` lines of its fdinfo)."""
    n = 0
    for fd in os.listdir("/proc/self/fdinfo"):
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                n += sum(1 for line in f if line.startswith("inotify wd:"))
        except OSError:
            continue
    return n


def test_directories_made_in_a_burst_are_all_watched(tmp_path):
    """Each real directory has a watch of its own, so new ones need a rebuild: nested and
    sibling directories made as fast as the host can, some moved in, all end up watched (later
    writes in each are events) and each file written before its directory's watch is hinted."""
    cps = tmp_path / ".checkpoints"
    cps.mkdir()
    roots = make_roots([str(cps)], str(tmp_path))
    reported: set[str] = set()
    deepest = [cps / f"u{i % 3}" / f"ctx{i}" / "sub" / "deeper" for i in range(12)]
    staged = tmp_path / "staged" / "tree" / "inner"  # outside the roots, then moved in

    async def on_paths(paths):
        reported.update(paths)

    async def on_roots_changed(changed):
        pass

    def hinted(path) -> bool:  # as an event, or inside a directory hint (the uploader scans those)
        return any(str(path) == p or str(path).startswith(p + "/") for p in reported)

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(watcher_mod.watch, roots, on_paths, on_roots_changed)
            baseline = _own_watches()
            for d in deepest:
                write_atomic(d / "early.json", b"e")
            write_atomic(staged / "moved.json", b"m")
            os.rename(tmp_path / "staged" / "tree", cps / "tree")
            dirs = [p for p in cps.rglob("*") if p.is_dir()]
            with anyio.fail_after(15):
                while _own_watches() != baseline + len(dirs):
                    await anyio.sleep(0.01)
                for d in dirs:
                    write_atomic(d / "later.json", b"l")
                while not all(str(d / "later.json") in reported for d in dirs):
                    await anyio.sleep(0.01)
            assert all(hinted(d / "early.json") for d in deepest)
            assert hinted(cps / "tree" / "inner" / "moved.json")
            tg.cancel_scope.cancel()

    anyio.run(main)


def _drain(uploader):
    """Every operation in the order the pending set lets them start (each done at once)."""
    order = []
    while (op := uploader.pending.take()) is not None:
        order.append((op.kind, op.key))
        uploader.pending.done(op)
    return order


def test_a_file_where_the_store_holds_the_other_shape_deletes_it_after_the_upload(tmp_path):
    """File ``a`` replaced by a directory holding ``a/x``, and directory ``d/`` (moved away: its
    files send no events) replaced by a file ``d``: the objects of the old shape are deleted with
    the change, each behind the barrier of the new shape's upload."""
    cps = tmp_path / ".checkpoints"
    roots = make_roots([str(cps)], str(tmp_path))
    uploader = Uploader(writer=None, roots=roots, ignore=IgnoreRules())
    for key in (".checkpoints/a", ".checkpoints/d/x", ".checkpoints/d/e/y", ".checkpoints/dz"):
        uploader.known.stored(key, ObjectInfo(key, 1, "0" * 64, 1, 0o600))
    write_atomic(cps / "a" / "x", b"new a/x")
    write_atomic(cps / "d", b"new d")
    uploader.mark_paths([str(cps / "a"), str(cps / "a" / "x"), str(cps / "d")])
    first = uploader.pending.take()
    second = uploader.pending.take()
    assert {(first.kind, first.key), (second.kind, second.key)} == {(UPLOAD, ".checkpoints/a/x"), (UPLOAD, ".checkpoints/d")}
    assert uploader.pending.take() is None, "an old shape's delete started before the new shape was stored"
    uploader.pending.done(first)
    uploader.pending.done(second)
    assert sorted(_drain(uploader)) == [(DELETE, ".checkpoints/a"), (DELETE, ".checkpoints/d/e/y"),
                                        (DELETE, ".checkpoints/d/x")]


def test_a_rebuild_replaced_before_it_was_pumped_has_its_directories_scanned_again(tmp_path):
    """A rebuilt engine waits (``next``) until the pump swaps it in; if more directories appear
    before that, a newer build replaces it, and the events it queued (a file written in a directory
    only it watched) go with it. So that build reports those directories again, for the uploader to
    scan once the newer engine watches them (a write after the scan is the newer engine's event)."""
    cps = tmp_path / ".checkpoints"
    cps.mkdir()
    w = watcher_mod._Watch([str(cps)])
    try:
        w.build()  # the engine being pumped: .checkpoints only
        (cps / "ctx").mkdir()
        assert w.build() == [str(cps / "ctx")]  # next: watches ctx too, not pumped yet
        write_atomic(cps / "ctx" / "written-before-the-swap.json", b"x")  # seen by next alone
        (cps / "other").mkdir()
        assert sorted(w.build()) == [str(cps / "ctx"), str(cps / "other")]  # next replaced
        w.swap()
        (cps / "third").mkdir()
        assert w.build() == [str(cps / "third")]  # a pumped engine's directories are not new again
    finally:
        w.close()
