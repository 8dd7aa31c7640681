"""The lineage record: a disk is the truth only for what this store and namespace put on it.

Real ``restore`` / ``sync`` / ``run`` processes against real files and the directory store. A
root carries ``.sidecar-lineage`` once a restore filled it (or found nothing to restore) or before
its first upload; a root with files and no matching record is merged from the store, never taken
for the truth: nothing stored is deleted because a new disk lacks it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from unittest.mock import ANY

import pytest

from sidecar.paths import RESTORE_MARKER, Root
from support import Sidecar, disk_tree, run_cli, seed_directory_store, sidecar_env, store_tree, wait_for, write_atomic

LINEAGE_FILE = ".sidecar-lineage"  # sidecar.paths.LINEAGE_FILE, spelled out: what a disk carries
STORED = {"resp_1/a.json": b'{"turn": 1}', "resp_2/b.json": os.urandom(20_000), "alice/approval.json": b"[]"}


def mirror(work: Path, env: dict[str, str], files: dict[str, bytes]) -> None:
    """A compute of the namespace writes ``files`` and mirrors them (``run -- true``)."""
    for rel, data in files.items():
        write_atomic(work / ".checkpoints" / rel, data)
    r = run_cli("run", "--", "true", cwd=work, env=env)
    assert r.returncode == 0, r.stderr


def seeded(tmp_path: Path, name: str = "store", prefix: str = "") -> tuple[dict[str, str], Path]:
    """A store holding STORED for ``.checkpoints``, written by another compute of the namespace."""
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / name), **({"SIDECAR_PREFIX": prefix} if prefix else {}))
    other = tmp_path / f"other-{name}-{prefix.replace('/', '-') or 'top'}"
    other.mkdir()
    mirror(other, env, STORED)
    return env, (tmp_path / name / prefix if prefix else tmp_path / name)


def sync_once(work: Path, env: dict[str, str], *args: str) -> Sidecar:
    sc = Sidecar(work, "sync", *args, env=env)
    sc.wait_event("ready", timeout=30)
    assert sc.stop() == 0, sc.log()[-3000:]
    return sc


def decision(sc: Sidecar) -> dict:
    return next(e for e in sc.events() if e.get("event") == "restore_decision" and e["root"].endswith(".checkpoints"))


def record(work: Path) -> dict | None:
    p = work / ".checkpoints" / LINEAGE_FILE
    return json.loads(p.read_bytes()) if p.exists() else None


# -- the record itself ------------------------------------------------------------------------


def test_a_restore_records_its_store_and_namespace_and_the_record_is_never_mirrored(tmp_path):
    env, top = seeded(tmp_path, prefix="team/s1")
    work = tmp_path / "work"
    work.mkdir()
    r = run_cli("restore", cwd=work, env=env)
    assert r.returncode == 0, r.stderr
    assert disk_tree(work / ".checkpoints") == STORED
    # the version: the highest stored of what the restore placed (a copy of this disk is older once more is)
    assert record(work) == {"store": f"file://{top}", "namespace": "team/s1", "generation": 1, "version": ANY,
                            "marker": ANY}
    assert record(work)["version"] > 0
    assert not (work / ".checkpoints" / RESTORE_MARKER).exists()
    sync_once(work, env)
    assert record(work) == {"store": f"file://{top}", "namespace": "team/s1", "generation": 2,  # its claim's
                            "version": ANY, "marker": ANY}
    assert not list(top.rglob(LINEAGE_FILE)), "the record was mirrored"
    assert store_tree(top) == STORED


def test_a_root_the_host_creates_later_is_recorded_before_its_first_upload(tmp_path):
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"))
    work = tmp_path / "work"
    work.mkdir()
    sc = Sidecar(work, "sync", env=env)
    try:
        sc.wait_event("ready", timeout=30)
        assert not (work / ".checkpoints").exists()  # nothing stored: the root is not even created
        write_atomic(work / ".checkpoints" / "c" / "1.json", b"x")
        wait_for(lambda: store_tree(tmp_path / "store") == {"c/1.json": b"x"}, 15, "the first upload", sc.log)
        # recorded with the generation of this sidecar's claim
        assert record(work) == {"store": f"file://{tmp_path / 'store'}", "namespace": "", "generation": 1,
                                "version": ANY, "marker": ANY}
        assert record(work)["version"] > 0  # raised before the upload was sent
        shutil.rmtree(work / ".checkpoints")  # the host removes the root, the record with it
        sc.wait_event("root_gone")  # a root gone as a whole is not "every file deleted"
        write_atomic(work / ".checkpoints" / "c" / "2.json", b"y")
        write_atomic(work / ".checkpoints" / "c" / "3.json", b"z")
        wait_for(lambda: len(store_tree(tmp_path / "store")) == 3, 15, "the new root's uploads", sc.log)
        assert record(work) is not None  # recorded again once back, the file it lacks kept
    finally:
        assert sc.stop() == 0, sc.log()[-3000:]
    (work / ".checkpoints" / "c" / "3.json").unlink()  # pruned while the sidecar is down
    sc = sync_once(work, env)
    assert "the disk is the truth" in decision(sc)["reason"]
    assert store_tree(tmp_path / "store") == {"c/1.json": b"x", "c/2.json": b"y"}


def test_record_io_is_safe_and_bounded(tmp_path):
    from sidecar.restorefs import Lineage, read_lineage, write_lineage

    root = Root(".checkpoints", str(tmp_path / ".checkpoints"))
    lineage = Lineage("file:///mnt/durable", "agents/s1")
    with pytest.raises(FileNotFoundError):
        write_lineage(root, lineage)  # never creates the root
    assert not os.path.exists(root.path)
    os.mkdir(root.path)
    assert read_lineage(root) is None
    write_lineage(root, lineage)
    assert read_lineage(root) == lineage  # no generation: none recorded
    write_lineage(root, Lineage(lineage.store, lineage.namespace, 7))
    assert read_lineage(root) == Lineage(lineage.store, lineage.namespace, 7)
    for generation in ('"7"', "-1", "true", "1.5"):  # a generation not ours counts as none
        (tmp_path / ".checkpoints" / LINEAGE_FILE).write_text(
            f'{{"store": "{lineage.store}", "namespace": "{lineage.namespace}", "generation": {generation}}}')
        assert read_lineage(root) == lineage, generation
    assert [n for n in os.listdir(root.path)] == [LINEAGE_FILE]  # no temp file left
    assert os.stat(os.path.join(root.path, LINEAGE_FILE)).st_mode & 0o777 == 0o600
    for garbage in (b"not json", b"[]", b'{"store": 1, "namespace": ""}', b'{"store": "x"}',
                    b'{"store": "x", "namespace": "' + b"y" * 70_000 + b'"}'):
        (tmp_path / ".checkpoints" / LINEAGE_FILE).write_bytes(garbage)
        assert read_lineage(root) is None, garbage
    os.unlink(os.path.join(root.path, LINEAGE_FILE))
    (tmp_path / "elsewhere").write_text(json.dumps({"store": lineage.store, "namespace": lineage.namespace}))
    os.symlink(tmp_path / "elsewhere", os.path.join(root.path, LINEAGE_FILE))
    assert read_lineage(root) is None  # a link is never followed


def test_local_files_are_compared_without_following_links(tmp_path):
    import hashlib

    from sidecar.localfs import local_matches

    root = Root(".checkpoints", str(tmp_path / ".checkpoints"))
    data = os.urandom(3 * 1024 * 1024 + 5)  # more than one hashing chunk
    write_atomic(tmp_path / ".checkpoints" / "d" / "f.bin", data)
    sha = hashlib.sha256(data).hexdigest()
    assert local_matches(root, ["d", "f.bin"], len(data), sha) is True
    assert local_matches(root, ["d", "f.bin"], len(data), "0" * 64) is False
    assert local_matches(root, ["d", "f.bin"], len(data) + 1, sha) is False
    assert local_matches(root, ["d", "f.bin"], len(data), None) is False  # nothing to compare with
    assert local_matches(root, ["d", "missing"], 1, sha) is None
    os.symlink(tmp_path / ".checkpoints" / "d", tmp_path / ".checkpoints" / "link")
    assert local_matches(root, ["link", "f.bin"], len(data), sha) is None
    os.symlink(tmp_path / ".checkpoints" / "d" / "f.bin", tmp_path / ".checkpoints" / "d" / "l.bin")
    assert local_matches(root, ["d", "l.bin"], len(data), sha) is None


# -- a new disk: merged, nothing stored deleted -----------------------------------------------


def test_a_stray_file_on_a_new_disk_is_merged_and_nothing_stored_is_deleted(tmp_path):
    env, top = seeded(tmp_path)
    work = tmp_path / "work"
    write_atomic(work / ".checkpoints" / "stray.json", b"from the image")
    sc = sync_once(work, env)
    d = decision(sc)
    assert d["restore"] is True
    assert d["reason"] == "root holds files but no record that this namespace filled it: merging from the store"
    start = next(e for e in sc.events() if e.get("event") == "reconcile_start")
    assert start["delete"] == 0, start
    assert store_tree(top) == {**STORED, "stray.json": b"from the image"}  # the stray file is mirrored as usual
    assert disk_tree(work / ".checkpoints") == {**STORED, "stray.json": b"from the image"}
    assert record(work) is not None


def test_a_differing_local_file_is_replaced_by_its_stored_version_and_never_uploaded(tmp_path):
    env, top = seeded(tmp_path)
    work = tmp_path / "work"
    write_atomic(work / ".checkpoints" / "resp_1" / "a.json", b'{"turn": 0}')  # an older copy
    write_atomic(work / ".checkpoints" / "alice" / "approval.json", STORED["alice/approval.json"])  # the same bytes
    sc = sync_once(work, env)
    replaced = [e for e in sc.events() if e.get("event") == "restore_replaced_local"]
    assert [(e["level"], e["path"]) for e in replaced] == [("warning", ".checkpoints/resp_1/a.json")]
    done = next(e for e in sc.events() if e.get("event") == "restore_done")
    assert (done["replaced"], done["in_place"], done["files"]) == (1, 1, 2), done
    assert disk_tree(work / ".checkpoints") == STORED
    assert store_tree(top) == STORED
    assert not any(e.get("event") == "uploaded" and e.get("path") == ".checkpoints/resp_1/a.json" for e in sc.events())


def test_a_disk_from_a_release_without_records_is_merged_then_trusted(tmp_path):
    """An upgrade: the disk holds files and no record (an earlier release wrote none). Not the
    truth: merged, so what the host pruned while no sidecar ran comes back (harmless) and nothing
    stored is deleted. From then on the disk carries the record, and prunes are mirrored."""
    env, top = seeded(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    assert run_cli("restore", cwd=work, env=env).returncode == 0
    (work / ".checkpoints" / LINEAGE_FILE).unlink()  # what an earlier release left
    (work / ".checkpoints" / "resp_2" / "b.json").unlink()
    sc = sync_once(work, env)
    assert "merging" in decision(sc)["reason"]
    done = next(e for e in sc.events() if e.get("event") == "restore_done")
    assert (done["files"], done["in_place"], done["replaced"]) == (1, 2, 0), done
    assert store_tree(top) == STORED and disk_tree(work / ".checkpoints") == STORED
    (work / ".checkpoints" / "resp_2" / "b.json").unlink()  # pruned while the sidecar is down
    sc = sync_once(work, env)
    assert "the disk is the truth" in decision(sc)["reason"]
    assert "resp_2/b.json" not in store_tree(top)


def test_a_crash_mid_restore_leaves_no_record_and_the_next_start_restores_again(tmp_path):
    files = {f"ctx{i % 10}/{i:04}.json": os.urandom(64 * 1024) for i in range(400)}
    seed_directory_store(tmp_path / "store", {f".checkpoints/{k}": v for k, v in files.items()})
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"))
    work = tmp_path / "work"
    cps = work / ".checkpoints"

    def placed() -> int:
        return sum(1 for _d, _s, names in os.walk(cps) for n in names if not n.startswith(".sidecar-"))

    for _attempt in range(5):
        write_atomic(cps / "stray.json", b"from the image")  # a merge, cut short
        sc = Sidecar(work, "restore", env=env)
        wait_for(lambda sc=sc: sc.proc.poll() is not None or placed() > 1, 60, "the first restored file", sc.log,
                 interval=0.001)
        sc.kill()
        if 1 < placed() < len(files) + 1:
            break
        shutil.rmtree(cps)
    else:
        pytest.fail("could not stop a restore half-way in 5 attempts")
    assert (cps / RESTORE_MARKER).exists() and not (cps / LINEAGE_FILE).exists()

    sc = sync_once(work, env)
    assert "cut short" in decision(sc)["reason"]
    assert store_tree(tmp_path / "store") == {**files, "stray.json": b"from the image"}
    assert disk_tree(cps) == {**files, "stray.json": b"from the image"}
    assert (cps / LINEAGE_FILE).exists() and not (cps / RESTORE_MARKER).exists()


def test_no_restore_on_a_new_disk_keeps_every_stored_file(tmp_path):
    env, top = seeded(tmp_path)
    work = tmp_path / "work"
    write_atomic(work / ".checkpoints" / "stray.json", b"from the image")
    sc = sync_once(work, env, "--no-restore")
    assert any(e.get("event") == "root_unproven_protected" for e in sc.events()), sc.log()
    assert store_tree(top) == {**STORED, "stray.json": b"from the image"}
    assert disk_tree(work / ".checkpoints") == {"stray.json": b"from the image"}
    assert record(work) is None  # still not this namespace's: a later restore merges


# -- the same disk: the truth, prunes mirrored ------------------------------------------------


@pytest.mark.parametrize("filled_by", ["restore", "the host"])
def test_a_restart_on_the_same_disk_mirrors_what_the_host_pruned_meanwhile(tmp_path, filled_by):
    if filled_by == "restore":
        env, top = seeded(tmp_path)
        work = tmp_path / "work"
        work.mkdir()
        assert run_cli("restore", cwd=work, env=env).returncode == 0
        sc = sync_once(work, env)  # a restore init container, then the mirror: the disk it filled is held
        assert "the disk is the truth" in decision(sc)["reason"]
    else:
        env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"))
        top = tmp_path / "store"
        work = tmp_path / "work"
        work.mkdir()
        mirror(work, env, STORED)
    (work / ".checkpoints" / "resp_2" / "b.json").unlink()  # the host prunes while the sidecar is down
    sc = sync_once(work, env)
    assert decision(sc)["restore"] is False and "the disk is the truth" in decision(sc)["reason"]
    assert store_tree(top) == {k: v for k, v in STORED.items() if k != "resp_2/b.json"}


def test_a_copied_volume_of_this_namespace_carries_its_record_and_is_the_truth(tmp_path):
    """A copy of this namespace's own disk (a volume cloned or restored from a volume backup) is
    this namespace's disk: the truth, so the store is made to match it."""
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"))
    a = tmp_path / "a"
    a.mkdir()
    mirror(a, env, STORED)
    b = tmp_path / "b"
    shutil.copytree(a, b, symlinks=True)
    (b / ".checkpoints" / "resp_2" / "b.json").unlink()
    sc = sync_once(b, env)
    assert "the disk is the truth" in decision(sc)["reason"]
    assert "resp_2/b.json" not in store_tree(tmp_path / "store")


@pytest.mark.slow  # its rule runs in process in tests/store/test_lineage_guards.py
def test_an_older_copy_of_this_namespace_disk_is_merged_and_never_rolls_the_store_back(tmp_path):
    """A copy of this namespace's disk taken before another compute of the session moved on (a
    ``cp -a`` snapshot, a node's disk that comes back) holds an older generation than the owner
    marker: merged, so the newer checkpoints stay stored and come to it."""
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"), SIDECAR_PREFIX="ns1")
    a = tmp_path / "a"
    a.mkdir()
    mirror(a, env, {"c1/one.json": b"v1"})
    b = tmp_path / "b"
    shutil.copytree(a, b, symlinks=True)
    mirror(a, env, {"c1/two.json": b"two", "c1/one.json": b"v2"})
    newer = {"c1/one.json": b"v2", "c1/two.json": b"two"}
    assert store_tree(tmp_path / "store" / "ns1") == newer
    sc = sync_once(b, env)
    assert "merging" in decision(sc)["reason"], decision(sc)
    assert store_tree(tmp_path / "store" / "ns1") == newer
    assert disk_tree(b / ".checkpoints") == newer
    # merged once: the disk is this namespace's now, so a prune on it is mirrored
    (b / ".checkpoints" / "c1" / "two.json").unlink()
    sc = sync_once(b, env)
    assert "the disk is the truth" in decision(sc)["reason"]
    assert store_tree(tmp_path / "store" / "ns1") == {"c1/one.json": b"v2"}


@pytest.mark.slow  # the rule runs in process in the fast suite (tests/store/test_lineage_guards.py)
@pytest.mark.parametrize("marker", ["deleted", "rolled back"])
def test_an_older_copy_is_merged_when_the_owner_marker_is_deleted_or_rolled_back(tmp_path, marker):
    """Issue #33, item 2: A writes a1, b1 (generation 1) and stops, its volume is copied; B writes a2
    and c.json (generation 2); the owner marker is then deleted (an operator "clearing a lock") or put
    back from a backup taken after A. The copy's record is no older than the marker, but the store
    holds a later generation: merged, the store keeps a2 and c.json."""
    import anyio

    from sidecar.marker import OWNER_KEY
    from sidecar.store.base import ObjectMeta
    from sidecar.store.directory import DirectoryStore

    async def on_marker(op):
        store = DirectoryStore(str(tmp_path / "store" / "ns1"))
        await store.open()
        try:
            return await op(store)
        finally:
            await store.aclose()

    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"), SIDECAR_PREFIX="ns1")
    a, b, copy = tmp_path / "a", tmp_path / "b", tmp_path / "copy"
    a.mkdir()
    b.mkdir()
    mirror(a, env, {"a.json": b"a1", "b.json": b"b1"})
    shutil.copytree(a, copy, symlinks=True)
    backup, info = anyio.run(on_marker, lambda store: store.get(OWNER_KEY))
    assert run_cli("restore", cwd=b, env=env).returncode == 0  # B: a later compute, restored, writes
    mirror(b, env, {"a.json": b"a2", "c.json": b"c"})
    newer = {"a.json": b"a2", "b.json": b"b1", "c.json": b"c"}
    assert store_tree(tmp_path / "store" / "ns1") == newer

    async def reset(store):
        await store.delete(OWNER_KEY)
        if marker == "rolled back":
            await store.put(OWNER_KEY, backup, ObjectMeta.of(backup, info.mtime_ns, 0o600, version=info.version))

    anyio.run(on_marker, reset)
    sc = sync_once(copy, env)
    assert "older generation" in decision(sc)["reason"], decision(sc)
    assert any(e.get("event") == "lineage_older" for e in sc.events())
    assert store_tree(tmp_path / "store" / "ns1") == newer, "the older copy rolled the store back"
    assert disk_tree(copy / ".checkpoints") == newer


# -- another namespace's or store's disk: refused ---------------------------------------------


@pytest.mark.slow  # its rule runs in process in tests/store/test_lineage_guards.py
def test_a_volume_of_another_session_is_refused_and_neither_namespace_changes(tmp_path):
    """Issue #33, item 3: session s1's volume attached to s2's compute. The start is refused, exit 2,
    one line naming both namespaces; nothing of s1 enters s2, nothing of either is deleted; moved
    aside as the line says, s2's own state is restored."""
    env1 = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"), SIDECAR_PREFIX="agent/s1")
    work = tmp_path / "work"
    work.mkdir()
    mirror(work, env1, {"s1-private.json": b"s1's"})
    env2, top2 = seeded(tmp_path, prefix="agent/s2")
    for command in (["sync"], ["run", "--", "true"], ["sync", "--no-restore"], ["restore"],
                    ["restore", "--as-of", "0s", "--force-restore"]):
        r = run_cli(*command, cwd=work, env=env2)
        assert r.returncode == 2, (command, r.stderr)
        [line] = [ln for ln in r.stderr.splitlines() if "error:" in ln]
        assert "refusing to" in line and "'agent/s1'" in line and "'agent/s2'" in line, line
        assert f"mv {work / '.checkpoints'} {work / '.checkpoints'}.foreign" in line, line
    assert store_tree(top2) == STORED, "another session's files entered this namespace"
    assert store_tree(tmp_path / "store" / "agent/s1") == {"s1-private.json": b"s1's"}
    assert disk_tree(work / ".checkpoints") == {"s1-private.json": b"s1's"}
    assert record(work)["namespace"] == "agent/s1"

    (work / ".checkpoints").rename(work / ".checkpoints.foreign")
    sync_once(work, env2)
    assert disk_tree(work / ".checkpoints") == STORED
    assert store_tree(top2) == STORED
    assert disk_tree(work / ".checkpoints.foreign") == {"s1-private.json": b"s1's"}


def test_a_volume_of_another_store_is_refused_and_that_store_loses_nothing(tmp_path):
    env_a = sidecar_env(SIDECAR_STORE=str(tmp_path / "a"))
    work = tmp_path / "work"
    work.mkdir()
    mirror(work, env_a, {"mine.json": b"from store a"})
    env_b, top_b = seeded(tmp_path, name="b")
    r = run_cli("sync", cwd=work, env=env_b)
    assert r.returncode == 2 and f"of file://{tmp_path / 'a'}" in r.stderr, r.stderr
    assert store_tree(top_b) == STORED
    assert store_tree(tmp_path / "a") == {"mine.json": b"from store a"}
    # taken in on purpose, as the line says: without the record it is merged like a new disk
    (work / ".checkpoints" / LINEAGE_FILE).unlink()
    sc = sync_once(work, env_b)
    assert "merging" in decision(sc)["reason"]
    assert store_tree(top_b) == {**STORED, "mine.json": b"from store a"}


@pytest.mark.azure
def test_an_azure_record_names_the_container_and_no_credential(tmp_path, azurite):
    from tests.azurite import unique_container

    url = azurite.container_url(unique_container("lineage"))
    env = sidecar_env(SIDECAR_STORE=url, SIDECAR_PREFIX="agents/s1", **azurite.env())
    work = tmp_path / "work"
    work.mkdir()
    mirror(work, env, {"a.json": b"a"})
    text = (work / ".checkpoints" / LINEAGE_FILE).read_text()
    assert json.loads(text) == {"store": f"{url}/agents/s1", "namespace": "agents/s1", "generation": 1, "version": ANY,
                                "marker": ANY}
    assert azurite.key not in text and "AccountKey" not in text
    shutil.rmtree(work / ".checkpoints")
    write_atomic(work / ".checkpoints" / "stray.json", b"image")
    sc = sync_once(work, env)
    assert "merging" in decision(sc)["reason"]
    assert disk_tree(work / ".checkpoints") == {"a.json": b"a", "stray.json": b"image"}


def test_a_root_the_restore_never_listed_keeps_its_stored_files(tmp_path):
    """The store could not be listed at start and SIDECAR_RESTORE_OPTIONAL started the host anyway
    (``prepare`` never ran): a root with files and no record is not the truth, so a later full
    listing deletes none of its stored files."""
    import anyio

    from sidecar.config import load
    from sidecar.daemon import Daemon
    from sidecar.listing import list_store
    from sidecar.store.directory import DirectoryStore

    env, top = seeded(tmp_path)
    work = tmp_path / "work"
    write_atomic(work / ".checkpoints" / "stray.json", b"from the image")
    settings, roots = load({"store": str(tmp_path / "store"), "reconcile_interval": 0}, cwd=str(work))
    store = DirectoryStore(str(tmp_path / "store"))

    async def main():
        await store.open()
        daemon = Daemon(settings, roots, store)  # no prepare: the restore never happened
        async with anyio.create_task_group() as tg:
            await tg.start(daemon.serve)
            assert ".checkpoints" in daemon.ledger.kept_roots
            listing = await list_store(store, roots)  # the store answers again
            await daemon.reconcile_listed(listing.objects)
            with anyio.fail_after(10):
                await daemon.uploader.wait_idle()
            tg.cancel_scope.cancel()
        await store.aclose()

    anyio.run(main)
    assert store_tree(top) == {**STORED, "stray.json": b"from the image"}
    assert record(work) is None


def test_a_stored_file_a_merge_cannot_place_is_kept_not_deleted(tmp_path):
    """A new disk holds a directory where a stored file goes: the merge refuses that file (nothing
    is written through or over the directory), records it in ``.sidecar-kept``, and its absence on
    disk deletes it on no start. (What the store does with the local directory's own files is the
    file/directory swap's rule, not the merge's.)"""
    env, top = seeded(tmp_path)
    work = tmp_path / "work"
    write_atomic(work / ".checkpoints" / "resp_1" / "a.json" / "inner.json", b"a directory of the image's")
    for _start in (1, 2):
        sc = sync_once(work, env)
        assert all(e["delete"] == 0 for e in sc.events() if e.get("event") in ("reconcile_start", "final_rescan"))
        assert ".checkpoints/resp_1/a.json" in json.loads((work / ".checkpoints" / ".sidecar-kept").read_text())
    assert (work / ".checkpoints" / "resp_1" / "a.json" / "inner.json").read_bytes() == b"a directory of the image's"
