"""An outside tester's attacks on the restore: a root holding only ignored files, a leftover bundle
older than the per-file objects, forged bundle headers (huge, of another root) and stored names of
the sidecar's own control files, and a symlink inside a directory store."""

from __future__ import annotations

import hashlib
import json
import os

import anyio
import pytest

from sidecar.known import StoreState
from sidecar.localfs import has_regular_files
from sidecar.metrics import Totals
from sidecar.paths import IgnoreRules, Root, UnsafeKey, split_key
from sidecar.restore.latest import RestoreError, lineage_of, restore
from sidecar.restorefs import write_lineage
from sidecar.snapshot import (
    MAX_BUNDLE_ENTRIES,
    MAX_HEADER_BYTES,
    BundleError,
    Change,
    Committer,
    bundle_key,
    bundle_parts,
    decode_bundle,
    encode_bundle,
)
from sidecar.store.base import NotFound, ObjectInfo, ObjectMeta, Stream
from sidecar.store.directory import DirectoryStore
from sidecar.writer import Writer
from support import disk_tree, json_lines, run_cli, seed_directory_store

OLD, NEW = 5 << 40 | 1, 7 << 40 | 1  # versions of an older and a newer writer (generation << 40 | counter)


class VersionedStore:
    """An in-memory store whose objects carry versions (``key -> (bytes, version)``)."""

    description = "memory://attacks"
    flat_namespace = False  # the store protocol's traits
    clock_is_local = False

    def __init__(self, objects: dict[str, tuple[bytes, int]]):
        self.objects = objects

    async def open(self):
        pass

    def _info(self, key):
        data, version = self.objects[key]
        return ObjectInfo(key, len(data), hashlib.sha256(data).hexdigest(), 1, 0o600, version=version)

    async def list(self, prefix=""):
        for k in list(self.objects):
            if k.startswith(prefix):
                yield self._info(k)

    async def get(self, key):
        if key not in self.objects:
            raise NotFound(key)
        return self.objects[key][0], self._info(key)

    async def get_stream(self, key):
        data, info = await self.get(key)

        async def chunks():
            for i in range(0, len(data), 4096):
                yield data[i : i + 4096]

        return Stream(info, chunks())

    async def delete(self, key):
        self.objects.pop(key, None)

    async def aclose(self):
        pass


def change(key: str, data: bytes | None) -> Change:
    return Change(key, data, None if data is None else ObjectMeta.of(data, 2, 0o600))


# -- 1. a root holding only ignored files holds no files ---------------------------------------

def test_ignored_and_control_files_do_not_make_a_root_hold_files(tmp_path):
    root = tmp_path / "r"
    (root / "ctx").mkdir(parents=True)
    for name in (".sidecar-kept", ".sidecar-restoring", ".sidecar-lineage", "ctx/.sidecar-restore-ab12", "ctx/1.json.tmp"):
        (root / name).write_bytes(b"x")
    assert not has_regular_files(str(root))
    (root / "ctx/1.json.part").write_bytes(b"x")
    assert has_regular_files(str(root))
    assert not has_regular_files(str(root), IgnoreRules(["*.part", "*.tmp"]))
    assert has_regular_files(str(root), IgnoreRules(["*.part"]))  # *.tmp is not ignored by these rules


@pytest.mark.parametrize("held", [False, True], ids=["new-disk", "this-namespace's-disk"])
def test_a_root_holding_only_a_temp_file_is_filled(tmp_path, held):
    store = VersionedStore({".checkpoints/ctx/1.json": (b"one", OLD), ".checkpoints/ctx/2.json": (b"two", OLD)})
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    os.makedirs(os.path.join(root.path, "ctx"))
    with open(os.path.join(root.path, "ctx/1.json.tmp"), "wb") as f:
        f.write(b"half a write")
    if held:  # the disk carries this namespace's record: a root with files would be the truth
        write_lineage(root, lineage_of(store, "ns"))
    _, result = anyio.run(lambda: restore(store, [root], namespace="ns", ignore=IgnoreRules()))
    (d,) = result.decisions
    assert (d.restore, d.merge, d.reason) == (True, False, "root is empty: filling it from the store")
    assert disk_tree(tmp_path / "w") == {".checkpoints/ctx/1.json": b"one", ".checkpoints/ctx/2.json": b"two"}


# -- 2. a leftover bundle never overrides newer per-file objects --------------------------------

def test_a_bundle_older_than_the_per_file_objects_is_not_laid_over_them(tmp_path):
    bundle = encode_bundle(".checkpoints", [change(".checkpoints/a.json", b'{"x":2}'),
                                            change(".checkpoints/b.json", None),
                                            change(".checkpoints/c.json", b"bundled c"),
                                            change(".checkpoints/d.json", b"bundled d")])
    store = VersionedStore({
        bundle_key(".checkpoints"): (bundle, OLD + 10),
        ".checkpoints/a.json": (b'{"x":99}', NEW),  # written file by file after the bundle was left
        ".checkpoints/b.json": (b"b kept", NEW),  # rewritten after the bundle's deletion
        ".checkpoints/c.json": (b"old c", OLD),  # older than the bundle: the bundle's state wins
    })
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    _, result = anyio.run(lambda: restore(store, [root]))
    assert disk_tree(tmp_path / "w") == {".checkpoints/a.json": b'{"x":99}', ".checkpoints/b.json": b"b kept",
                                         ".checkpoints/c.json": b"bundled c", ".checkpoints/d.json": b"bundled d"}
    assert result.files == 4


def test_a_bundle_newer_than_the_per_file_objects_still_decides(tmp_path):
    """A snapshot commit cut short: its bundle holds the newer state (the commit's own puts come
    after it, at higher versions and with its bytes)."""
    bundle = encode_bundle(".checkpoints", [change(".checkpoints/a.json", b"new a"), change(".checkpoints/b.json", None),
                                            change(".checkpoints/c.json", b"new c")])
    store = VersionedStore({bundle_key(".checkpoints"): (bundle, NEW), ".checkpoints/a.json": (b"old a", OLD),
                            ".checkpoints/b.json": (b"old b", OLD), ".checkpoints/c.json": (b"new c", NEW + 1)})
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    anyio.run(lambda: restore(store, [root]))
    assert disk_tree(tmp_path / "w") == {".checkpoints/a.json": b"new a", ".checkpoints/c.json": b"new c"}


def _committer(store, roots):
    return Committer(Writer(store), roots, IgnoreRules(), StoreState(), max_file_size=2**30, totals=Totals())


def test_a_per_file_sidecar_drops_its_roots_stale_bundles_at_start_up(tmp_path):
    bundle = encode_bundle(".checkpoints", [change(".checkpoints/a.json", b"a"), change(".checkpoints/b.json", b"b")])
    store = VersionedStore({bundle_key(".checkpoints"): (bundle, OLD), bundle_key(".kept"): (bundle, OLD),
                            bundle_key("not-ours"): (bundle, OLD), ".checkpoints/a.json": (b"a", NEW)})
    roots = [Root(".checkpoints", str(tmp_path / ".checkpoints")), Root(".kept", str(tmp_path / ".kept"))]
    # per-file mode: no snapshot roots; .kept's disk is not the truth; something is pending
    anyio.run(lambda: _committer(store, roots).drop_stale_bundles(set(), {".kept"}, lambda: {".checkpoints/b.json"}))
    assert sorted(store.objects) == sorted([bundle_key(".kept"), bundle_key("not-ours"), ".checkpoints/a.json"])


# -- 3. forged bundles --------------------------------------------------------------------------

def test_a_huge_forged_header_is_refused_with_bounded_memory(monkeypatch):
    """750k deletions in a 31 MB header: refused by its size before any of it is parsed (parsing it
    reached 393 MB RSS), so the memory it can take is the header bound, whatever it holds."""
    from sidecar import tarstream
    from sidecar.snapshot import MANIFEST_NAME, _member, _pad

    head = bytearray(b'{"version":2,"root":"state","entries":[')
    for i in range(750_000):
        head += b'%s{"key":"state/%07d","deleted":true}' % (b"," if i else b"", i)
    head += b"]}"
    assert len(head) > MAX_HEADER_BYTES
    blob = _member(MANIFEST_NAME, len(head), 0o600, 0) + head + _pad(len(head)) + bytes(1024)

    def parsed(*args, **kwargs):
        raise AssertionError("the header was parsed")

    monkeypatch.setattr(tarstream.json, "loads", parsed)
    with pytest.raises(BundleError, match="larger than"):
        decode_bundle(bytes(blob))


def test_a_header_naming_too_many_entries_is_refused():
    head = json.dumps({"version": 1, "root": "r", "entries": [{"key": "r/a", "deleted": True}] * (MAX_BUNDLE_ENTRIES + 1)})
    assert len(head) < MAX_HEADER_BYTES
    with pytest.raises(BundleError, match=f"more than {MAX_BUNDLE_ENTRIES} entries"):
        decode_bundle(head.encode() + b"\n")


def test_a_batch_larger_than_a_bundle_is_committed_in_parts_each_readable():
    long = "d/" + "é" * 300  # escaped in the header: six bytes a character
    changes = [change(f"r/{i}", None) for i in range(2 * MAX_BUNDLE_ENTRIES + 3)]
    changes += [change(f"r/{long}{i}", None) for i in range(3000)]
    parts = bundle_parts("r", changes)
    assert [c for p in parts for c in p] == changes
    for p in parts:
        assert len(p) <= MAX_BUNDLE_ENTRIES
        blob = encode_bundle("r", p)
        assert decode_bundle(blob) == ("r", p)  # the reader takes every bundle the writer makes
    assert bundle_parts("r", changes[:10]) == [changes[:10]]


def test_a_bundle_naming_another_root_is_refused(tmp_path):
    bundle = encode_bundle("other", [change("state/a.json", b"forged"), change("state/b.json", b"forged")])
    store = VersionedStore({bundle_key("state"): (bundle, NEW), "state/a.json": (b"real", OLD)})
    root = Root("state", str(tmp_path / "w" / "state"))
    with pytest.raises(RestoreError, match="names the root 'other'"):
        anyio.run(lambda: restore(store, [root]))
    assert not os.path.exists(os.path.join(root.path, "a.json"))


CONTROL = [".sidecar-kept", ".sidecar-restoring", ".sidecar-lineage", ".sidecar-restore-1a2b3c", "sub/.sidecar-lineage"]


@pytest.mark.parametrize("name", CONTROL)
def test_split_key_refuses_the_sidecars_own_file_names(name):
    roots = {"state": Root("state", "/x/state")}
    with pytest.raises(UnsafeKey, match="sidecar's own files"):
        split_key(f"state/{name}", roots)
    assert split_key("state/sidecar-kept", roots)[1] == ["sidecar-kept"]


def test_stored_and_bundled_control_file_names_are_refused_and_kept(tmp_path):
    forged_kept = json.dumps([]).encode()
    bundle = encode_bundle("state", [change("state/.sidecar-lineage", b'{"store":"x","namespace":"y"}'),
                                     change("state/ok.json", b"ok")])
    store = VersionedStore({
        bundle_key("state"): (bundle, NEW),
        "state/.sidecar-kept": (forged_kept, OLD), "state/.sidecar-restoring": (b"x", OLD),
        "state/.sidecar-restore-abcd": (b"x", OLD), "state/real.json": (b"real", OLD),
    })
    root = Root("state", str(tmp_path / "w" / "state"))
    listing, result = anyio.run(lambda: restore(store, [root], namespace="ns"))
    assert sorted(result.refused) == ["state/.sidecar-kept", "state/.sidecar-lineage", "state/.sidecar-restore-abcd",
                                      "state/.sidecar-restoring"]
    assert sorted(os.listdir(root.path)) == [".sidecar-lineage", "ok.json", "real.json"]
    with open(os.path.join(root.path, ".sidecar-lineage")) as f:  # the sidecar's own record, not the forged one
        assert json.load(f)["namespace"] == "ns"
    assert sorted(listing.objects) == ["state/real.json"]  # the refused ones stay stored: never taken for deleted
    assert "state/.sidecar-kept" in store.objects


# -- 4. a symlink inside a directory store ------------------------------------------------------

def test_a_listing_that_skips_a_link_inside_the_store_says_so_once(work):
    work, store = work
    seed_directory_store(store, {".checkpoints/a.json": b"a", ".checkpoints/c1/b.json": b"b"})
    elsewhere = store.parent / "elsewhere"
    os.rename(store / ".checkpoints" / "c1", elsewhere)
    os.symlink(elsewhere, store / ".checkpoints" / "c1")
    r = run_cli("restore", "--store", str(store), cwd=work)
    assert r.returncode == 0, r.stderr
    warned = [e for e in json_lines(r.stderr) if e.get("event") == "store_link_skipped"]
    assert len(warned) == 1 and warned[0]["path"] == ".checkpoints/c1", r.stderr
    assert disk_tree(work / ".checkpoints") == {"a.json": b"a"}

    async def list_twice():  # one warning per link, however often the store is listed
        s = DirectoryStore(str(store))
        await s.open()
        return [[i.key async for i in s.list()] for _ in range(2)]

    assert anyio.run(list_twice) == [[".checkpoints/a.json"]] * 2
