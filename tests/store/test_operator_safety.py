"""No command an operator is told to run harms a live session (issue #34), in process, on both
stores: ``release`` refuses a live owner (which goes on mirroring) unless ``--force``; a read-only
``restore --as-of`` into empty roots needs neither the session's identity nor a hand-over; the
refusals that still need an identity name the exact variables and the store."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from sidecar import lifecycle
from sidecar.config import load
from sidecar.fence import Fence, Fenced
from sidecar.marker import OWNER_KEY
from sidecar.points.plan import AsOf
from sidecar.store.base import ObjectMeta
from tests.pointkit import write_point

pytestmark = pytest.mark.anyio

NS = "sessions/approvals/s3"
S3 = {"FOUNDRY_AGENT_SESSION_ID": "s3"}


@pytest.fixture
def settings_for(store_place, monkeypatch, tmp_path):
    """``settings_for(**variables)``: the settings and roots a command loads from ``SIDECAR_*``
    variables on this store (its credentials in the process environment, where the store reads
    them), with no session of its own."""
    url, creds = store_place
    for k, v in creds.items():
        monkeypatch.setenv(k, v)
    for k in ("FOUNDRY_AGENT_SESSION_ID", "FOUNDRY_AGENT_NAME"):
        monkeypatch.delenv(k, raising=False)

    def make(cwd: Path | None = None, **variables: str):
        env = {"HOME": str(tmp_path), "SIDECAR_STORE": url, "SIDECAR_PREFIX": NS, **variables}
        return load({}, cwd=str(cwd or tmp_path), env=env)

    return make


async def live_owner(make_store) -> tuple[object, Fence]:
    """The namespace of session s3 with a sidecar mirroring it: its claim made, files stored."""
    store = await make_store(NS)
    for name in ("a.json", "b.json"):
        data = f"s3 {name}".encode()
        await store.put(f".checkpoints/{name}", data, ObjectMeta.of(data, 1, 0o600, version=1))
    fence = Fence(store, 0.5, 0.0, identity=S3, namespace=NS, interval=900.0)
    await fence.claim()
    await fence.before_write()
    return store, fence


async def still_owns(fence: Fence) -> bool:
    """Whether the fence's next proof (a marker read, forced now) finds it still the owner."""
    fence.valid_until = 0.0
    try:
        await fence.before_write()
    except Fenced:
        return False
    return True


async def test_release_refuses_a_live_owner_which_goes_on_mirroring(make_store, settings_for, capsys):
    store, fence = await live_owner(make_store)
    before = await store.get(OWNER_KEY)
    settings, roots = settings_for()

    assert await lifecycle.release(settings, roots) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "refusing to release the namespace 'sessions/approvals/s3'" in err[0]
    assert "FOUNDRY_AGENT_SESSION_ID=s3 holds it" in err[0] and " s ago by the store's clock" in err[0], err
    assert "Traceback" not in err[0]
    # the way on is a whole command, pasteable: store, prefix, no session (issue #34, item 6)
    assert err[0].endswith(f"SIDECAR_PREFIX={NS} SIDECAR_SESSION_NAMESPACE=off checkpoint-sidecar release --force"), err
    assert "SIDECAR_STORE=" in err[0]
    after = await store.get(OWNER_KEY)
    assert (after[0], after[1].version) == (before[0], before[1].version)
    assert await still_owns(fence)

    # --force: released, and the owner is fenced at its next proof
    assert await lifecycle.release(settings, roots, force=True) == 0
    assert "its owner had not released it" in capsys.readouterr().out
    assert not await still_owns(fence)


async def test_release_of_an_owner_that_released_needs_no_force(make_store, settings_for, capsys):
    _, fence = await live_owner(make_store)
    settings, roots = settings_for()
    assert await lifecycle.release(settings, roots) == 2  # live
    await fence.release(5.0)  # a clean exit: heartbeat 0
    capsys.readouterr()
    assert await lifecycle.release(settings, roots) == 0, capsys.readouterr().err
    assert "released the namespace 'sessions/approvals/s3'" in capsys.readouterr().out


async def test_release_refuses_a_namespace_a_prune_is_deleting(make_store, settings_for, capsys):
    import json

    store = await make_store(NS)
    stamp = 9 << 32
    data = json.dumps({"generation": stamp, "owner": "prune:x", "heartbeat": 1, "identity": S3,
                       "prune": {"phase": "deleting"}}).encode()
    await store.put(OWNER_KEY, data, ObjectMeta.of(data, stamp, 0o600, version=stamp))
    settings, roots = settings_for()
    assert await lifecycle.release(settings, roots) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "a prune is deleting it" in line and "half-deleted" in line, line
    # both ways on are whole commands, pasteable (issue #34, item 6)
    assert f"SIDECAR_PREFIX={NS} SIDECAR_SESSION_NAMESPACE=off checkpoint-sidecar prune --older-than 7d;" in line, line
    assert line.endswith(f"SIDECAR_PREFIX={NS} SIDECAR_SESSION_NAMESPACE=off checkpoint-sidecar release --force"), line
    assert (await store.get(OWNER_KEY))[0] == data


async def test_restore_as_of_into_empty_roots_needs_no_identity(make_store, settings_for, tmp_path, capsys):
    """The issue's first finding: ``restore --as-of`` of a live session's namespace without its
    identity was refused, and the hint was a ``release`` that fenced the session. Into empty
    roots it only reads: it restores, claims nothing, and the owner goes on."""
    store, fence = await live_owner(make_store)
    await write_point(store, 100)
    before = await store.get(OWNER_KEY)
    work = tmp_path / "inspect"
    work.mkdir()
    settings, roots = settings_for(cwd=work)
    assert not settings.namespace.identity

    assert await lifecycle.restore(settings, roots, AsOf(ago=0.0)) == 0, capsys.readouterr().err
    assert (work / ".checkpoints" / "a.json").read_bytes() == b"s3 a.json"
    after = await store.get(OWNER_KEY)
    assert (after[0], after[1].version) == (before[0], before[1].version)
    assert await still_owns(fence)


async def test_restore_as_of_over_files_still_needs_the_identity_and_names_it(make_store, settings_for, store_place,
                                                                               tmp_path, capsys):
    """With --force-restore (roots that hold files: a compute's own) the identity is still
    checked; the refusal names the exact variables and the store, and shows no credential."""
    store, fence = await live_owner(make_store)
    await write_point(store, 100)
    work = tmp_path / "compute"
    (work / ".checkpoints").mkdir(parents=True)
    (work / ".checkpoints" / "mine.json").write_bytes(b"another session's")
    settings, roots = settings_for(cwd=work, SIDECAR_RESTORE="force")

    assert await lifecycle.restore(settings, roots, AsOf(ago=0.0)) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "belongs to FOUNDRY_AGENT_SESSION_ID=s3" in line, line
    variables = line.split("with these variables: ", 1)[1].split(";", 1)[0]
    assigned = dict(w.split("=", 1) for w in shlex.split(variables))
    assert assigned == {"SIDECAR_STORE": store_place[0], "SIDECAR_PREFIX": NS, "SIDECAR_SESSION_NAMESPACE": "off",
                        **S3}, variables
    # those variables give the namespace and its identity, whatever SIDECAR_PREFIX was
    same, _ = settings_for(cwd=work, **assigned)
    assert (same.namespace.path, same.namespace.identity) == (NS, S3)
    assert (work / ".checkpoints" / "mine.json").read_bytes() == b"another session's"  # nothing restored
    assert await still_owns(fence)


async def test_restore_as_of_into_roots_a_sidecar_may_mirror_is_refused(make_store, settings_for, store_place, tmp_path,
                                                                        capsys):
    """Empty roots, but recorded as a disk a sidecar may be mirroring (outside tester, round 2:
    the live sidecar uploaded what the as-of restore placed): another namespace's record is
    refused whoever owns it; this namespace's own record while its owner is live. A directory
    without a record is a fresh one: restored."""
    from sidecar.restore.finish import lineage_of
    from sidecar.restorefs import write_lineage

    store, fence = await live_owner(make_store)
    await write_point(store, 100)
    settings, _ = settings_for(cwd=tmp_path)
    for recorded, why in (("agent/s2", "recorded as the disk of the store namespace 'agent/s2'"),
                          (NS, "into roots recorded as its disk: the namespace is live")):
        work = tmp_path / recorded.replace("/", "-")
        (work / ".checkpoints").mkdir(parents=True)
        settings, roots = settings_for(cwd=work)
        [root] = [r for r in roots if r.name == ".checkpoints"]
        write_lineage(root, replace(lineage_of(store, recorded), store=store.description.replace(NS, recorded)))
        assert await lifecycle.restore(settings, roots, AsOf(ago=0.0)) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert why in line, line
        assert not (work / ".checkpoints" / "a.json").exists()  # nothing placed
    assert await still_owns(fence)


async def test_release_refuses_an_unreadable_marker_written_within_the_live_window(make_store, settings_for, capsys):
    """A marker that cannot be read tells no owner, but one written seconds ago may be a live
    sidecar's (outside tester, round 2: the release a refusal recommends fenced a live owner).
    Refused, as a live owner is, unless --force."""
    store = await make_store(NS)
    garbled = b"not a marker {"
    await store.put(OWNER_KEY, garbled, ObjectMeta.of(garbled, 1 << 32, 0o600, version=1 << 32))
    settings, roots = settings_for()
    assert await lifecycle.release(settings, roots) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "its marker cannot be read (not a JSON object), yet it was written" in line, line
    assert line.endswith("checkpoint-sidecar release --force"), line
    assert (await store.get(OWNER_KEY))[0] == garbled
    assert await lifecycle.release(settings, roots, force=True) == 0, capsys.readouterr().err
