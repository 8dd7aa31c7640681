"""The lineage record's guards (issue #33, items 2 and 3), in process, on every store.

* **An older copy of the disk never rolls the store back.** A compute writes ``a1``, ``b1``
  (generation 1) and stops; its disk is copied. A later compute writes ``a2`` and ``c.json``
  (generation 2). Then the owner marker is deleted (an operator "clearing a lock") or put back
  from a backup taken after the first compute. The copy carries this namespace's record and a
  generation no older than the marker's, but the store holds a later generation: it is merged
  (the stored newer files win, nothing stored is deleted), never taken for the truth.
* **Another session's volume never crosses into this one.** A disk whose record names another
  namespace refuses the start (exit 2), nothing of either namespace changed; once the root is
  moved aside, this namespace's own state is restored.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import anyio
import pytest

from sidecar.errors import EXIT_CONFIG
from sidecar.marker import OWNER_KEY
from sidecar.store.base import NotFound, ObjectMeta
from support import disk_tree, write_atomic
from tests.inprocess import InProcess, run_sync, settings_for

pytestmark = pytest.mark.anyio
#: whole sessions in process: the rules on the memory store in the fast suite, the other stores in CI's
#: second tier (tests/conftest.py)
FAST_BACKENDS = ("memory",)

ROOT = ".checkpoints"


async def stored(store) -> dict[str, bytes]:
    """The root's files as stored (key below the root -> bytes); a key deleted between the
    listing and its read (a sidecar still running) is not stored."""
    out = {}
    async for info in store.list(ROOT + "/"):
        try:
            out[info.key[len(ROOT) + 1:]] = (await store.get(info.key))[0]
        except NotFound:
            continue
    return out


async def mirror(make_store, work: Path, writes: dict[str, bytes] | None = None, prefix: str = "") -> InProcess:
    """One compute: restore, write ``writes`` (paths below the root) once mirroring, drain, exit 0.
    Its own store (the lifecycle closes it)."""
    # a short fence window: a claim over a held (or deleted) marker waits it out, then checks
    s, roots = settings_for(work, "unused", restore_point_interval=0, reconcile_interval=0, prefix=prefix,
                            fence_window=0.2, fence_margin=0.2)
    store = await make_store(prefix)
    life = InProcess(s, roots, store)

    async def host(_: InProcess) -> None:
        for rel, data in (writes or {}).items():
            write_atomic(work / ROOT / rel, data)
        with anyio.fail_after(30):  # every write stored (the drain would send them anyway)
            while {k: v for k, v in (await stored(store)).items() if k in (writes or {})} != (writes or {}):
                await anyio.sleep(0.01)  # a poll's pace

    assert await run_sync(life, host) == 0
    return life


@pytest.mark.parametrize("marker", ["deleted", "rolled back"])
async def test_an_older_copy_of_the_disk_is_merged_never_the_truth(make_store, tmp_path, marker):
    store = await make_store("")
    a, b, copy = tmp_path / "a", tmp_path / "b", tmp_path / "copy"
    a.mkdir()
    b.mkdir()
    await mirror(make_store, a, {"ctx/a.json": b"a1", "ctx/b.json": b"b1"})  # generation 1
    shutil.copytree(a, copy)  # its volume is copied (the record with it)
    backup, backup_info = await store.get(OWNER_KEY)  # a backup of the marker taken after A
    await mirror(make_store, b, {"ctx/a.json": b"a2", "ctx/c.json": b"c"})  # generation 2
    newer = {"ctx/a.json": b"a2", "ctx/b.json": b"b1", "ctx/c.json": b"c"}
    assert await stored(store) == newer

    await store.delete(OWNER_KEY)  # an operator "clearing a lock"
    if marker == "rolled back":  # put back from the backup
        await store.put(OWNER_KEY, backup, ObjectMeta.of(backup, backup_info.mtime_ns, 0o600, version=backup_info.version))

    life = await mirror(make_store, copy)
    assert await stored(store) == newer, "the older copy rolled the store back"
    assert disk_tree(copy / ROOT) == newer  # the stored newer files won
    [d] = [d for d in life.daemon.startup.restored.decisions if d.name == ROOT]
    assert d.merge and "older generation" in d.reason, d
    assert life.daemon.startup.restored.replaced == [f"{ROOT}/ctx/a.json"]

    # merged once: the disk is this namespace's now, so a host's delete is mirrored again
    (copy / ROOT / "ctx" / "c.json").unlink()
    life = await mirror(make_store, copy)
    [d] = [d for d in life.daemon.startup.restored.decisions if d.name == ROOT]
    assert not d.restore and "the disk is the truth" in d.reason, d
    assert await stored(store) == {"ctx/a.json": b"a2", "ctx/b.json": b"b1"}


async def test_the_newest_disk_stays_the_truth_when_the_marker_is_deleted(make_store, tmp_path):
    """The guard's other side: the disk of the last compute, its marker deleted, is still held."""
    store = await make_store("")
    work = tmp_path / "work"
    work.mkdir()
    await mirror(make_store, work, {"ctx/a.json": b"a1", "ctx/b.json": b"b1"})
    await mirror(make_store, work, {"ctx/a.json": b"a2"})
    await store.delete(OWNER_KEY)
    (work / ROOT / "ctx" / "b.json").unlink()  # pruned by the host while the sidecar was down
    life = await mirror(make_store, work)
    [d] = [d for d in life.daemon.startup.restored.decisions if d.name == ROOT]
    assert not d.restore and "the disk is the truth" in d.reason, d
    assert await stored(store) == {"ctx/a.json": b"a2"}


async def test_another_sessions_volume_is_refused_and_neither_namespace_changes(make_store, tmp_path):
    s1, s2 = await make_store("agent/s1"), await make_store("agent/s2")
    vol, other = tmp_path / "s1-volume", tmp_path / "s2-other"
    vol.mkdir()
    other.mkdir()
    await mirror(make_store, vol, {"s1-private.json": b"s1's"}, prefix="agent/s1")
    await mirror(make_store, other, {"s2.json": b"s2's"}, prefix="agent/s2")
    before = disk_tree(vol)

    settings, roots = settings_for(vol, "unused", prefix="agent/s2", reconcile_interval=0)
    with anyio.fail_after(60):  # (the old rule started mirroring: no exit)
        assert await InProcess(settings, roots, await make_store("agent/s2")).main() == EXIT_CONFIG  # s1's volume on s2's compute
    assert await stored(s2) == {"s2.json": b"s2's"}, "another session's files entered this namespace"
    assert await stored(s1) == {"s1-private.json": b"s1's"}
    assert disk_tree(vol) == before  # nothing moved, nothing deleted

    # what the refusal says to do: move the root aside; this namespace's own state comes back
    (vol / ROOT).rename(vol / f"{ROOT}.agent-s1")
    await mirror(make_store, vol, prefix="agent/s2")
    assert disk_tree(vol / ROOT) == {"s2.json": b"s2's"}
    assert await stored(s2) == {"s2.json": b"s2's"}
    assert await stored(s1) == {"s1-private.json": b"s1's"}


async def test_another_sessions_volume_behind_an_unreadable_directory_is_refused(make_store, tmp_path, monkeypatch):
    """s1's volume whose files sit in a directory s2's sidecar cannot read: not taken for empty
    (it was: s2 replaced the record, and once the directory became readable uploaded s1's file)."""
    s2 = await make_store("agent/s2")
    vol = tmp_path / "s1-volume"
    vol.mkdir()
    await mirror(make_store, vol, {"private/s1-private.json": b"s1's"}, prefix="agent/s1")
    hidden, scandir = str(vol / ROOT / "private"), os.scandir

    def unreadable(path):  # as a user without the right to read it (tests may run as root)
        if str(path) == hidden:
            raise PermissionError(13, "Permission denied", path)
        return scandir(path)

    monkeypatch.setattr(os, "scandir", unreadable)
    settings, roots = settings_for(vol, "unused", prefix="agent/s2", reconcile_interval=0)
    with anyio.fail_after(60):
        assert await InProcess(settings, roots, await make_store("agent/s2")).main() == EXIT_CONFIG
    monkeypatch.setattr(os, "scandir", scandir)
    assert await stored(s2) == {}, "another session's files entered this namespace"
    assert "agent/s1" in (vol / ROOT / ".sidecar-lineage").read_text()


@pytest.mark.parametrize("damage", ["empty", "garbage", "wrong types", "a directory", "unreadable"])
async def test_another_sessions_volume_whose_record_cannot_be_read_is_refused(make_store, tmp_path, monkeypatch,
                                                                                  damage, capsys):
    """A lineage record there but not readable as one may name another namespace: the start is
    refused like a record naming another (outside tester, round 2: it counted as no record, and
    s1's file was uploaded into s2). Once the record is removed on purpose, the disk is merged."""
    s2 = await make_store("agent/s2")
    vol = tmp_path / "s1-volume"
    vol.mkdir()
    await mirror(make_store, vol, {"s1-private.json": b"s1's"}, prefix="agent/s1")
    record = vol / ROOT / ".sidecar-lineage"
    if damage == "unreadable":  # as a user without the right to read it (tests may run as root)
        real_open = os.open

        def denied(path, flags, *args, **kw):
            if str(path) == ".sidecar-lineage" and kw.get("dir_fd") is not None and not flags & os.O_CREAT:
                raise PermissionError(13, "Permission denied", path)
            return real_open(path, flags, *args, **kw)

        monkeypatch.setattr(os, "open", denied)
    elif damage == "a directory":
        record.unlink()
        record.mkdir()
    else:
        record.write_text({"empty": "", "garbage": "garbage{", "wrong types": '{"namespace": 7, "store": 1}'}[damage])
    settings, roots = settings_for(vol, "unused", prefix="agent/s2", reconcile_interval=0)
    with anyio.fail_after(60):
        assert await InProcess(settings, roots, await make_store("agent/s2")).main() == EXIT_CONFIG
    assert await stored(s2) == {}, "another session's files entered this namespace"
    assert (vol / ROOT / "s1-private.json").read_bytes() == b"s1's"
    assert "its lineage record" in capsys.readouterr().err


@pytest.mark.parametrize("then", ["released", pytest.param("held", marks=pytest.mark.slow)])
async def test_a_copy_taken_mid_session_is_merged_never_the_truth(make_store, tmp_path, then):
    """A copy of the disk (a volume snapshot) taken while the session ran, started after the
    session wrote more: same generation as the marker, whether released or still held, yet older
    than the store (outside tester, round 2: it was the truth, and the checkpoints written after
    the copy were deleted from the store). Every write raises the record's version first."""
    store = await make_store("")
    work, copy = tmp_path / "work", tmp_path / "copy"
    work.mkdir()
    s, roots = settings_for(work, "unused", restore_point_interval=0, reconcile_interval=0)
    life = InProcess(s, roots, await make_store(""))

    async def host(_: InProcess) -> None:
        for name, then_copy in (("one.json", True), ("two.json", False), ("three.json", False)):
            write_atomic(work / ROOT / "ctx" / name, name.encode())
            with anyio.fail_after(30):
                while name not in {k.rsplit("/", 1)[-1] for k in await stored(store)}:
                    await anyio.sleep(0.01)  # a poll's pace
            if then_copy:
                shutil.copytree(work, copy, symlinks=True)

    assert await run_sync(life, host) == 0
    if then == "held":  # as if the session's sidecar had died without releasing the namespace
        marker = json.loads((await store.get(OWNER_KEY))[0])
        marker["heartbeat"] = 1.0
        data = json.dumps(marker).encode()
        info = (await store.get(OWNER_KEY))[1]
        await store.put(OWNER_KEY, data, ObjectMeta.of(data, info.version, 0o600, version=info.version))
    everything = {f"ctx/{n}": n.encode() for n in ("one.json", "two.json", "three.json")}
    assert await stored(store) == everything

    copied = await mirror(make_store, copy)
    [d] = [d for d in copied.daemon.startup.restored.decisions if d.name == ROOT]
    assert "the disk is the truth" not in d.reason, d
    assert await stored(store) == everything, "the copy rolled the store back"
    assert disk_tree(copy / ROOT) == everything  # merged: the later files restored beside the copy's


@pytest.mark.parametrize("marker", ["with an id", "of an earlier release"])
async def test_a_disk_filled_against_a_store_that_was_not_mounted_is_merged(tmp_path, marker):
    """The store's volume was not mounted once (an empty directory at its path), then was again:
    the disk a compute filled against the empty one has a record of the same store, namespace and
    generation, yet is not the real store's disk (outside tester, round 2: taken for the truth, it
    deleted the session's checkpoints). The marker's lineage id tells the two apart: merged."""
    from sidecar.store.directory import DirectoryStore

    path = tmp_path / "mnt" / "store"
    path.mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()

    async def compute(writes: dict[str, bytes]) -> InProcess:
        s, roots = settings_for(work, str(path), restore_point_interval=0, reconcile_interval=0)
        store = DirectoryStore(str(path), "")
        life = InProcess(s, roots, store)

        async def host(_: InProcess) -> None:
            for rel, data in writes.items():
                write_atomic(work / ROOT / rel, data)
            with anyio.fail_after(30):
                while {k: v for k, v in (await stored(store)).items() if k in writes} != writes:
                    await anyio.sleep(0.01)  # a poll's pace

        assert await run_sync(life, host) == 0
        return life

    await compute({"ctx/A.json": b"A", "ctx/B.json": b"B"})  # the real store, on its volume
    if marker == "of an earlier release":  # paused under a release whose marker had no lineage id
        real = DirectoryStore(str(path), "")
        await real.open()
        data, info = await real.get(OWNER_KEY)
        fields = {k: v for k, v in json.loads(data).items() if k != "lineage"}
        data = json.dumps(fields).encode()
        await real.put(OWNER_KEY, data, ObjectMeta.of(data, info.mtime_ns, 0o600, version=info.version))
        await real.aclose()
    shutil.rmtree(work)
    work.mkdir()  # a new compute's empty disk
    path.rename(tmp_path / "volume")  # the volume is not mounted: an empty directory at its path
    path.mkdir()
    more = {f"ctx/C{i}.json": b"C" for i in range(5)}  # more writes than the real store's: a higher version
    await compute(more)
    path.rename(tmp_path / "mount-point")  # (what was written onto the mount point stays under it)
    (tmp_path / "volume").rename(path)  # mounted again; the compute's container restarts on its disk
    life = await compute({})
    [d] = [d for d in life.daemon.startup.restored.decisions if d.name == ROOT]
    assert "the disk is the truth" not in d.reason, d
    real = DirectoryStore(str(path), "")
    await real.open()
    assert await stored(real) == {"ctx/A.json": b"A", "ctx/B.json": b"B", **more}
    await real.aclose()
