"""The directory store never leaves its top: a symlink planted below the base (a namespace's
directory, a root's, a nested one, the records' tree, a lock file, a data file) is never followed,
never removed, and the put, get, delete or listing that would pass through it fails in one line
naming the key (a listing skips a link inside the namespace). Each case is a real store whose one
directory is replaced by a link to the same directory of an identical store outside: whatever an
operation does through the link shows in that outside store."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from sidecar.store.base import ObjectMeta, StoreError
from sidecar.store.directory import DirectoryStore
from sidecar.store.dirfs import _lock_name

pytestmark = pytest.mark.anyio

PREFIX = "agent/s1"
KEY = ".checkpoints/ctx/c.json"  # behind every link below
OTHER = ".checkpoints/other.json"  # behind the namespace's and the root's links only
FAKE_SHA = "f" * 64
STAMP = 1_700_000_000_000_000_000


def meta(data: bytes, version: int = 1) -> ObjectMeta:
    return ObjectMeta.of(data, STAMP, 0o600, version)


def snapshot(top) -> dict:
    """Every entry below ``top``: bytes of files, targets of links, and each one's mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, top)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isfile(p):
                out[rel] = ("file", Path(p).read_bytes(), st.st_mtime_ns)
            else:
                out[rel] = ("dir",)
    return out


async def twin_stores(tmp_path, link: str):
    """``(store, outside)``: ``outside`` holds a store with KEY and OTHER (its records vouching
    for a fake sha256, so that a record read through the link shows); ``store`` is its copy in
    which ``link`` (below the base) is a symlink to the same path in ``outside``."""
    outside = tmp_path / "outside"
    seed = DirectoryStore(str(outside), PREFIX)
    await seed.open()
    await seed.put(KEY, b"outside's c", meta(b"outside's c"))
    await seed.put(OTHER, b"outside's other", meta(b"outside's other"))
    for rec in (outside / PREFIX / ".sidecar-meta").rglob("*.json"):
        rec.write_text(json.dumps({**json.loads(rec.read_text()), "sha256": FAKE_SHA}))
    base = tmp_path / "store"
    shutil.copytree(outside, base, symlinks=True)
    for rec in (base / PREFIX / ".sidecar-meta").rglob("*.json"):  # the store's own records are true
        data_key = str(rec.relative_to(base / PREFIX / ".sidecar-meta"))[:-len(".json")]
        data = (base / PREFIX / data_key).read_bytes()
        rec.write_text(json.dumps({**json.loads(rec.read_text()), "sha256": meta(data).sha256}))
    target = base / link
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    os.symlink(outside / link, target)
    return DirectoryStore(str(base), PREFIX), outside


def refused(e: pytest.ExceptionInfo, key: str | None, link: str) -> None:
    msg = str(e.value)
    assert "\n" not in msg and "refusing to follow the symlink" in msg, msg
    assert repr(link) in msg and (key is None or repr(key) in msg), msg


DATA_LINKS = [PREFIX.split("/")[0], PREFIX, f"{PREFIX}/.checkpoints", f"{PREFIX}/.checkpoints/ctx",
              f"{PREFIX}/{KEY}"]
RECORD_LINKS = [f"{PREFIX}/.sidecar-meta", f"{PREFIX}/.sidecar-meta/.checkpoints",
                f"{PREFIX}/.sidecar-meta/.checkpoints/ctx", f"{PREFIX}/.sidecar-meta/{KEY}.json"]


@pytest.mark.parametrize("link", DATA_LINKS, ids=["namespace", "namespace leaf", "root", "nested", "data file"])
async def test_a_link_on_the_datas_way_is_refused_by_every_operation(tmp_path, link):
    store, outside = await twin_stores(tmp_path, link)
    before = snapshot(outside)
    namespace = link in DATA_LINKS[:2]
    behind = [KEY, OTHER] if link in DATA_LINKS[:3] else [KEY]
    if namespace:
        with pytest.raises(StoreError) as e:
            await store.open()
        refused(e, PREFIX, link)
    else:
        await store.open()
    for key in behind:
        with pytest.raises(StoreError) as e:
            await store.put(key, b"must not land outside", meta(b"must not land outside", version=9))
        refused(e, key, link)
        with pytest.raises(StoreError) as e:
            await store.get(key)
        refused(e, key, link)
        with pytest.raises(StoreError) as e:
            await store.get_stream(key)
        refused(e, key, link)
        with pytest.raises(StoreError) as e:
            await store.delete(key)
        refused(e, key, link)
    if namespace:
        with pytest.raises(StoreError) as e:
            [i async for i in store.list()]
        refused(e, None, link)
    else:  # a listing does not descend into the link, and lists the rest
        listed = {i.key: i async for i in store.list()}
        assert sorted(listed) == sorted({KEY, OTHER} - set(behind))
        if OTHER not in behind:
            assert listed[OTHER].sha256 == meta(b"outside's other").sha256
            assert (await store.get(OTHER))[0] == b"outside's other"
            info = await store.put(OTHER, b"mine", meta(b"mine", version=2))  # beside the link: fine
            assert info.version == 2 and (await store.get(OTHER))[0] == b"mine"
        await store.put("elsewhere/x", b"x", meta(b"x"))  # the rest of the store works
        await store.delete("elsewhere/x")
    assert snapshot(outside) == before, "something was written or removed through the link"
    assert os.path.islink(tmp_path / "store" / link), "the link was removed"


@pytest.mark.parametrize("link", RECORD_LINKS, ids=["records", "root's records", "nested records", "record"])
async def test_a_link_on_the_records_way_is_never_followed(tmp_path, link):
    store, outside = await twin_stores(tmp_path, link)
    before = snapshot(outside)
    await store.open()
    behind = [KEY, OTHER] if link in RECORD_LINKS[:2] else [KEY]
    for key in behind:
        with pytest.raises(StoreError) as e:
            await store.put(key, b"must not land outside", meta(b"must not land outside", version=9))
        refused(e, key, link)
        with pytest.raises(StoreError) as e:
            await store.delete(key)
        refused(e, key, link)
    # reads go on, but a record behind a link is not read: that object is unverified
    data, info = await store.get(KEY)
    assert data == b"outside's c" and info.sha256 is None
    listed = {i.key: i.sha256 async for i in store.list()}
    assert listed == {KEY: None, OTHER: None if OTHER in behind else meta(b"outside's other").sha256}
    if OTHER not in behind:
        await store.put(OTHER, b"mine", meta(b"mine", version=2))
        await store.delete(OTHER)
    assert snapshot(outside) == before, "something was written or removed through the link"
    assert os.path.islink(tmp_path / "store" / link), "the link was removed"


@pytest.mark.parametrize("key", [".sidecar/owner", KEY], ids=["own object's lock", "key's lock"])
async def test_a_link_in_place_of_a_lock_file_is_refused(tmp_path, key):
    base, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"precious")
    store = DirectoryStore(str(base), PREFIX)
    await store.open()
    (base / PREFIX / ".sidecar-meta").mkdir()
    link = f"{PREFIX}/.sidecar-meta/{_lock_name(key)}"
    os.symlink(outside / "precious", base / link)
    with pytest.raises(StoreError) as e:
        await store.put(key, b"x", meta(b"x"))
    refused(e, key, link)
    assert [p.name for p in outside.iterdir()] == ["precious"] and (outside / "precious").read_bytes() == b"precious"
    assert os.path.islink(base / link)


async def test_a_link_among_stale_objects_in_a_files_way_is_never_removed(tmp_path):
    """Key ``a`` replaces a directory of stale objects ``a/...``; a symlink among them is not
    ours: the put is refused and nothing is removed, through the link or beside it."""
    base, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"precious")
    store = DirectoryStore(str(base), PREFIX)
    await store.open()
    await store.put("r/a/old.json", b"old", meta(b"old"))
    os.symlink(outside, base / PREFIX / "r" / "a" / "ln")
    with pytest.raises(StoreError) as e:
        await store.put("r/a", b"now a file", meta(b"now a file"))
    refused(e, "r/a", f"{PREFIX}/r/a/ln")
    assert os.path.islink(base / PREFIX / "r" / "a" / "ln")
    assert (await store.get("r/a/old.json"))[0] == b"old"
    assert [p.name for p in outside.iterdir()] == ["precious"]


async def test_the_base_itself_may_be_a_symlink(tmp_path):
    """A mount point is often reached through a link (the operator's own setting): it is followed."""
    real = tmp_path / "mnt" / "share"
    real.mkdir(parents=True)
    os.symlink(real, tmp_path / "store")
    store = DirectoryStore(str(tmp_path / "store"), PREFIX)
    await store.open()
    await store.put(KEY, b"data", meta(b"data"))
    assert (real / PREFIX / KEY).read_bytes() == b"data"
    assert (await store.get(KEY))[0] == b"data"
    assert [i.key async for i in store.list()] == [KEY]
    await store.delete(KEY)
    assert [i.key async for i in store.list()] == []


@pytest.mark.parametrize("command", [("run", "--", "true"), ("sync",), ("restore",), ("status",)])
def test_a_sidecar_whose_namespace_directory_is_a_link_refuses_it_in_one_line(tmp_path, command):
    """The finding as a user meets it: ``<store>/agent -> elsewhere`` under ``SIDECAR_PREFIX=agent/s1``.
    Real processes: each command fails in one line naming the link, and nothing lands outside."""
    from support import run_cli, sidecar_env, write_atomic

    store, outside, work = tmp_path / "store", tmp_path / "outside", tmp_path / "w"
    (outside / "s1").mkdir(parents=True)
    store.mkdir()
    os.symlink(outside, store / "agent")
    write_atomic(work / ".checkpoints" / "c.json", b'{"a": 1}')
    r = run_cli(*command, cwd=work, env=sidecar_env(SIDECAR_STORE=str(store), SIDECAR_PREFIX="agent/s1"), timeout=60)
    assert r.returncode not in (0, 75), r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to follow the symlink 'agent'" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert snapshot(outside) == {"s1": ("dir",)}
    assert os.path.islink(store / "agent")


async def test_a_record_nested_past_the_parsers_depth_is_no_record(tmp_path):
    """A metadata record of ``[[[…]]]`` a couple of thousand deep (under the record size cap) raised
    RecursionError out of json.loads: listing, restore and verify ended as an unexpected error.
    It is a record the store cannot vouch for, like any other malformed one."""
    store = DirectoryStore(str(tmp_path / "store"))
    await store.open()
    await store.put("r/a.json", b"{}", ObjectMeta.of(b"{}", 1, 0o600, version=5))
    (tmp_path / "store" / ".sidecar-meta" / "r" / "a.json.json").write_bytes(b"[" * 2000 + b"]" * 2000)
    (info,) = [i async for i in store.list()]
    assert info.key == "r/a.json" and info.sha256 is None and info.version == 0
    await store.aclose()
