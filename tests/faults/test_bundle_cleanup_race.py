"""The start-up cleanup of a stale snapshot bundle racing the root's next snapshot commit.

A bundle left by a cut-short commit is deleted at start-up when its root has nothing to commit.
If the host writes meanwhile, the root's snapshot worker commits: bundle, files, bundle deleted.
The cleanup's delete must not interleave with that: when its answer came back after the commit
had written its own bundle, the cleanup marked the root as having no bundle, the commit then
skipped deleting its bundle, and that bundle stayed in the store, where a later restore would lay
its (by then old) content over newer files. Deterministic: the store holds the cleanup's answer
until the commit's files are written (a store answering late; the real directory store beneath).
"""

from __future__ import annotations

import anyio
import pytest

from sidecar.paths import IgnoreRules, make_roots
from sidecar.snapshot import bundle_key
from sidecar.store.base import NotFound, ObjectMeta
from sidecar.store.directory import DirectoryStore
from sidecar.uploader import Uploader
from sidecar.writer import Writer
from support import write_atomic

pytestmark = pytest.mark.faults


class SlowCleanupAnswer(DirectoryStore):
    """The first bundle delete is applied at once but answered only once ``release`` is set."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.release = anyio.Event()
        self.cleanup_applied = anyio.Event()
        self.file_puts = 0

    async def delete(self, key: str) -> None:
        await super().delete(key)
        if key.startswith(".sidecar/bundles/") and not self.cleanup_applied.is_set():
            self.cleanup_applied.set()
            await self.release.wait()

    async def put(self, key, data, meta, **conditions):
        info = await super().put(key, data, meta, **conditions)
        if not key.startswith(".sidecar/"):
            self.file_puts += 1
            if self.file_puts == 2:  # the commit's files are in: the cleanup's answer arrives now
                self.release.set()
                for _ in range(5):  # and is handled before this put returns
                    await anyio.sleep(0)
        return info


def test_the_stale_bundle_cleanup_never_leaves_a_commits_bundle_behind(tmp_path):
    state = tmp_path / "state"
    roots = make_roots([str(state)], str(tmp_path))
    store = SlowCleanupAnswer(str(tmp_path / "store"))
    stale = b"a bundle a cut-short commit left"
    name = roots[0].name

    async def main():
        await store.open()
        await store.put(bundle_key(name), stale, ObjectMeta.of(stale, 1, 0o600))
        uploader = Uploader(Writer(store), roots, IgnoreRules(), snapshot_roots={name})
        uploader.known.add_bundle(name)
        write_atomic(state / "a.json", b"a")
        write_atomic(state / "b.json", b"b")
        committed = []

        async def commit():
            committed.append(await uploader.committer.commit(roots[0], [f"{name}/a.json", f"{name}/b.json"]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(uploader.drop_stale_bundles, set())
            await store.cleanup_applied.wait()  # the cleanup's delete is out, its answer not back
            tg.start_soon(commit)
            with anyio.fail_after(10):
                while not store.release.is_set():
                    # a commit that waits for the cleanup to finish gets its answer now
                    lock = getattr(uploader.committer, "_locks", {}).get(name)
                    if lock is not None and lock.statistics().tasks_waiting:
                        store.release.set()
                    await anyio.sleep(0.001)
        assert committed == [True]
        with pytest.raises(NotFound):
            await store.get(bundle_key(name))
        assert uploader.known.bundles() == set()
        assert (await store.get(f"{name}/a.json"))[0] == b"a"

    anyio.run(main)


def test_a_bundle_a_fenced_predecessor_left_after_our_listing_is_dropped(tmp_path):
    """The predecessor, fenced in the middle of a commit, wrote its bundle after our start-up
    listing (so we never learnt of it): the cleanup, once the claim's wait is over, lists the
    bundles again and deletes it rather than leave it for a later restore to lay over our files."""
    state = tmp_path / "state"
    roots = make_roots([str(state)], str(tmp_path))
    name = roots[0].name
    left = b"the predecessor's half-applied commit"

    async def main():
        store = DirectoryStore(str(tmp_path / "store"))
        await store.open()
        uploader = Uploader(Writer(store), roots, IgnoreRules(), snapshot_roots={name})
        assert uploader.known.bundles() == set()  # what our start-up listing found
        await store.put(bundle_key(name), left, ObjectMeta.of(left, 1, 0o600))  # then it landed
        await uploader.drop_stale_bundles(set())
        with pytest.raises(NotFound):
            await store.get(bundle_key(name))
        await store.aclose()

    anyio.run(main)
