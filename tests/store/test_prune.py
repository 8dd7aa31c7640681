"""sessions and prune on both stores: 50 namespaces (live, released, stale, with restore points),
listed exactly, only the ended ones pruned and wholly; a namespace claimed between prune's pending
and deleting phases keeps every object; a dry run deletes nothing; a pruned session's recreated
compute (the real ``restore`` process) starts empty and says so; the gauges reach a Pushgateway.
Also the store's clock and its conditional delete."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import anyio
import pytest

from sidecar.fence import Fence, Fenced
from sidecar.marker import OWNER_KEY, read_marker
from sidecar.ops.namespaces import StoreClock, walk
from sidecar.ops.pruner import SKIPPED, Pruner
from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore
from sidecar.takeover import Taken, take_for_restore
from support import run_cli, sidecar_cmd, sidecar_env

pytestmark = pytest.mark.anyio

SESSION = "FOUNDRY_AGENT_SESSION_ID"
LIVE_WITHIN = 2.0  # seconds: the stale markers are made older than this by the store's clock


def ident(name: str) -> dict[str, str]:
    return {SESSION: name}


async def put_marker(store, name: str, *, heartbeat: float, interval: float | None, stamp: int = 5 << 32) -> None:
    body: dict = {"generation": stamp, "owner": "x" * 32, "heartbeat": heartbeat, "identity": ident(name)}
    if interval is not None:
        body["interval"] = interval
    data = json.dumps(body).encode()
    await store.put(OWNER_KEY, data, ObjectMeta.of(data, stamp, 0o600, version=stamp))


async def seed(store, name: str, points: int) -> None:
    for f in ("a.json", "b.json"):
        data = f"{name}/{f}".encode()
        await store.put(f".checkpoints/{f}", data, ObjectMeta.of(data, 1, 0o600, version=1))
    for i in range(points):
        await store.put(f".sidecar/points/{i:04d}", b"p", ObjectMeta.of(b"p", 1, 0o600, version=1))


async def wait_store_age(store, since: float, age: float) -> None:
    with anyio.fail_after(30):
        while await store.now() - since < age:
            await anyio.sleep(0.2)


@pytest.fixture
async def fifty(make_store):
    """50 namespaces below ``agents/``: 15 stale, 15 released, 20 live (some with points). The
    stale ones are made first and aged past LIVE_WITHIN by the store's clock; the live ones record
    a heartbeat interval of 900 s (live for 30 min whatever LIVE_WITHIN is)."""
    kinds = {f"s{i:02d}": ("stale" if i < 15 else "released" if i < 30 else "live") for i in range(50)}
    newest = 0.0
    for name, kind in kinds.items():
        if kind == "live":
            continue
        store = await make_store(f"agents/_/{name}")
        await seed(store, name, points=int(name[1:]) % 3)
        await put_marker(store, name, heartbeat=0 if kind == "released" else 1.0, interval=0.5)
        newest = max(newest, (await store.get(OWNER_KEY))[1].modified or 0.0)
    top = await make_store("agents")
    await wait_store_age(top, newest, LIVE_WITHIN + 1.5)
    for name, kind in kinds.items():
        if kind == "live":
            store = await make_store(f"agents/_/{name}")
            await seed(store, name, points=int(name[1:]) % 3)
            await put_marker(store, name, heartbeat=time.time(), interval=900)
    return kinds


def cli_env(store_place, **extra: str) -> dict[str, str]:
    url, creds = store_place
    return sidecar_env(SIDECAR_STORE=url, SIDECAR_FENCE_WINDOW="0.3", SIDECAR_FENCE_MARGIN="0", **creds, **extra)


async def keys_below(make_store, prefix: str) -> list[str]:
    store = await make_store(prefix)
    return [i.key async for i in store.list() if ".sidecar-meta" not in i.key.split("/")]


@pytest.mark.slow
async def test_sessions_lists_each_namespace_exactly(fifty, store_place, tmp_path):
    r = await anyio.to_thread.run_sync(lambda: run_cli("sessions", "--json", "--live-within", "2s", cwd=tmp_path,
                                                       env=cli_env(store_place)))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(rows) == 50
    by = {row["namespace"]: row for row in rows}
    for name, kind in fifty.items():
        row = by[f"agents/_/{name}"]
        points = int(name[1:]) % 3
        assert row["owner"] == kind, row
        assert row["identity"] == ident(name)
        assert (row["files"], row["points"], row["objects"]) == (2, points, 3 + points)
        assert row["bytes"] > 0 and row["last_write"].endswith("Z")
    text = await anyio.to_thread.run_sync(lambda: run_cli("sessions", cwd=tmp_path, env=cli_env(store_place)))
    assert text.returncode == 0 and len(text.stdout.splitlines()) == 51  # a header and a line each


@pytest.mark.slow
async def test_prune_removes_only_ended_namespaces_and_all_of_each(fifty, store_place, make_store, tmp_path):
    dry = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--force", "--live-within", "2s",
                                                         "--dry-run", cwd=tmp_path, env=cli_env(store_place)))
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("would prune agents/_/") == 30 and "nothing deleted" in dry.stdout
    assert len(await keys_below(make_store, "agents")) == 50 * 3 + sum(int(n[1:]) % 3 for n in fifty)

    r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--force", "--live-within", "2s",
                                                       cwd=tmp_path, env=cli_env(store_place)))
    assert r.returncode == 0, r.stderr
    assert "pruned 30 namespaces" in r.stdout.splitlines()[-1], r.stdout
    for name, kind in fifty.items():
        left = await keys_below(make_store, f"agents/_/{name}")
        if kind == "live":
            assert len(left) == 3 + int(name[1:]) % 3, (name, left)
        else:
            assert left == [], (name, left)

    # the recreated compute of a pruned session starts empty and says so in one line
    work = tmp_path / "compute"
    (work / ".checkpoints").mkdir(parents=True)
    env = cli_env(store_place, SIDECAR_PREFIX="agents", **{SESSION: "s20"})
    back = await anyio.to_thread.run_sync(lambda: run_cli("restore", cwd=work, env=env))
    assert back.returncode == 0, back.stderr
    said = [line for line in back.stderr.splitlines() if "starting empty" in line]
    assert len(said) == 1 and '"namespace_empty"' in said[0], back.stderr
    assert [p.name for p in (work / ".checkpoints").iterdir() if not p.name.startswith(".sidecar-")] == []


async def test_a_namespace_claimed_during_prune_keeps_every_object(make_store):
    store = await make_store("s1")
    await seed(store, "s1", points=2)
    await put_marker(store, "s1", heartbeat=0, interval=900)  # released: eligible at --older-than 0s
    before = sorted([i.key async for i in store.list()])
    top = await make_store()

    async def claim_meanwhile(namespace: str) -> None:
        # a recreated compute starting now: the sidecar's own start-up path
        taken = await take_for_restore(await make_store(namespace), ident("s1"), namespace)
        assert taken.stamp

    pruner = Pruner(lambda ns: _fresh(make_store, ns), time.time, 0.2, 0.0, 0.0, 60.0, on_pending=claim_meanwhile)
    results = [await pruner.prune(ns) for ns in [n async for n in walk(top, 60.0)]]
    assert [(r.namespace, r.outcome) for r in results] == [("s1", SKIPPED)]
    assert sorted([i.key async for i in store.list()]) == before
    marker = await read_marker(store)
    assert marker["owner"].startswith("resuming:") and "prune" not in marker

    # the claim after the restore takes it from there, without waiting out a write window
    fence = Fence(store, 0.2, 30.0, identity=ident("s1"), namespace="s1",
                  taken=Taken(5, marker["generation"], True, False, True))
    await fence.claim()
    assert fence.writable_at <= time.monotonic()


async def test_a_pruned_namespace_leaves_nothing_behind(make_store):
    """Every object of an ended namespace goes, and on a directory store its lock files (dozens:
    one per stripe its keys hashed to) and directories go with it; a live namespace beside it
    keeps its own."""
    ended, live = await make_store("s1"), await make_store("s2")
    for store in (ended, live):
        for i in range(40):  # keys on most of the lock stripes
            await store.put(f".checkpoints/k{i}", b"k", ObjectMeta.of(b"k", 1, 0o600, version=1))
        await seed(store, store.description, points=2)
    await put_marker(ended, "s1", heartbeat=0, interval=900)  # released: eligible at --older-than 0s
    await put_marker(live, "s2", heartbeat=time.time(), interval=900)
    top = await make_store()
    clock = await StoreClock.of(top)
    pruner = Pruner(lambda ns: _fresh(make_store, ns), clock.now, 0.2, 0.0, 0.0, 60.0)
    [await pruner.prune(ns) async for ns in walk(top, 60.0, clock)]
    assert {i.key.split("/")[0] async for i in top.list()} == {"s2"}
    if isinstance(top, DirectoryStore):
        assert not os.path.exists(os.path.join(top.top, "s1")), os.listdir(os.path.join(top.top, "s1"))
        assert len([n for n in os.listdir(os.path.join(live.top, ".sidecar-meta")) if "lock" in n]) > 10


@pytest.mark.parametrize("heartbeat", [0, 1.0])  # released, stale
async def test_a_prune_cancelled_in_its_grace_puts_the_marker_back(make_store, heartbeat):
    """Issue #34, item 6: a prune cancelled (Ctrl-C) after its pending marker left that marker, and
    the resuming sidecar waited out a write window, saying its predecessor had not released the
    namespace, though the prune's marker was all there was. The marker it replaced is put back:
    a released one is released again (no wait), a stale one is the stale owner's again."""
    store = await make_store("s1")
    await seed(store, "s1", points=1)
    await put_marker(store, "s1", heartbeat=heartbeat, interval=None)  # stale at once with live_within 0
    before = sorted([i.key async for i in store.list()])
    original = {k: v for k, v in (await read_marker(store)).items() if not k.startswith("_")}
    top = await make_store()
    namespaces = [n async for n in walk(top, 60.0)]

    async def cancelled(namespace: str) -> None:
        assert (await read_marker(await make_store(namespace)))["prune"] == {"phase": "pending"}
        scope.cancel()

    pruner = Pruner(lambda ns: _fresh(make_store, ns), time.time, 0.2, 0.0, 0.0, 0.0, on_pending=cancelled)
    with anyio.CancelScope() as scope:
        await pruner.prune(namespaces[0])
    assert scope.cancelled_caught
    assert sorted([i.key async for i in store.list()]) == before
    marker = await read_marker(store)
    assert {k: v for k, v in marker.items() if not k.startswith("_")} == original

    taken = await take_for_restore(store, ident("s1"), "s1")
    fence = Fence(store, 0.2, 30.0, identity=ident("s1"), namespace="s1", taken=taken)
    await fence.claim()
    assert (fence.writable_at <= time.monotonic()) == (heartbeat == 0)  # a stale owner is waited out


@pytest.mark.process
async def test_prune_interrupted_in_its_grace_exits_130_and_changes_nothing(make_store, store_place, tmp_path):
    """The process: Ctrl-C while the namespace waits its grace ends the prune (130), the released
    marker is back as it was, and every object is kept."""
    store = await make_store("s1")
    await seed(store, "s1", points=1)
    await put_marker(store, "s1", heartbeat=0, interval=900)
    before = sorted([i.key async for i in store.list()])
    original = (await store.get(OWNER_KEY))[0]
    env = cli_env(store_place)
    env["SIDECAR_FENCE_WINDOW"] = "600"  # a grace that outlasts the test: only the signal ends it
    proc = subprocess.Popen(sidecar_cmd("prune", "--older-than", "0s", "--force"), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with anyio.fail_after(60):
            while "pending" not in (await read_marker(store)).get("prune", {}).get("phase", ""):
                assert proc.poll() is None, proc.communicate()
                await anyio.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=60))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err
    assert (await store.get(OWNER_KEY))[0] == original
    assert sorted([i.key async for i in store.list()]) == before


class _Fresh:
    """A namespace's store made by the test's factory on open (the Pruner opens and closes it)."""

    def __init__(self, make_store, namespace: str) -> None:
        self.make_store, self.namespace, self.store = make_store, namespace, None

    async def open(self) -> None:
        self.store = await self.make_store(self.namespace)

    async def aclose(self) -> None:
        return None

    def __getattr__(self, name: str):
        return getattr(self.store, name)


def _fresh(make_store, namespace: str) -> _Fresh:
    return _Fresh(make_store, namespace)


async def test_a_sidecar_waits_for_a_deleting_prune_then_starts_empty(make_store):
    store = await make_store("s1")
    await seed(store, "s1", points=0)
    stamp = 7 << 32
    data = json.dumps({"generation": stamp, "owner": "prune:x", "heartbeat": 1, "identity": ident("s1"),
                       "prune": {"phase": "deleting"}}).encode()
    await store.put(OWNER_KEY, data, ObjectMeta.of(data, stamp, 0o600, version=stamp))
    got: list[Taken] = []

    async def start() -> None:
        got.append(await take_for_restore(store, ident("s1"), "s1", poll=0.05))

    async with anyio.create_task_group() as tg:
        tg.start_soon(start)
        await anyio.sleep(0.3)
        assert not got, "it must wait while the prune deletes"
        # a claim meanwhile (a restore that raced the prune) is fenced
        with pytest.raises(Fenced, match="being pruned"):
            await Fence(store, 0.2, 0.0, identity=ident("s1"), namespace="s1").claim()
        assert await store.delete_if(OWNER_KEY, stamp)
    assert got[0].pruned and not got[0].stamp


async def test_the_store_clock_and_conditional_delete(make_store):
    store = await make_store("n")
    info = await store.put("r/x", b"1", ObjectMeta.of(b"1", 1, 0o600, version=3))
    modified = (await store.get("r/x"))[1].modified
    now = await store.now()
    assert modified is not None and abs(now - modified) < 5  # the same clock, read twice
    assert not await store.delete_if("r/x", 4)
    assert not await store.delete_if("r/missing", 0)
    assert (await store.get("r/x"))[0] == b"1"
    assert await store.delete_if("r/x", info.version)
    assert [i.key async for i in store.list()] == []


class _Gateway(BaseHTTPRequestHandler):
    got: list[tuple[str, str, bytes]] = []
    auth: list[str | None] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.got.append((self.command, self.path, body))
        self.auth.append(self.headers.get("Authorization"))
        self.send_response(200)
        self.end_headers()

    do_PUT = do_POST  # noqa: N815

    def log_message(self, *args) -> None:
        return None


@pytest.mark.process
async def test_prune_pushes_its_gauges(make_store, store_place, tmp_path):
    store = await make_store("s1")
    await seed(store, "s1", points=1)
    await put_marker(store, "s1", heartbeat=0, interval=900)
    server = HTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # a gateway behind basic auth: the user and password in the URL (issue #34, item 6), escaped
        url = f"http://pr%40une:s3cr%3At@127.0.0.1:{server.server_address[1]}"
        r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--force", "--pushgateway", url,
                                                           cwd=tmp_path, env=cli_env(store_place)))
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stderr
    assert _Gateway.auth[-1] == "Basic " + base64.b64encode(b"pr@une:s3cr:t").decode()
    assert "s3cr" not in r.stdout + r.stderr
    method, path, body = _Gateway.got[-1]
    assert method == "POST" and path == "/metrics/job/checkpoint_sidecar_prune"
    text = body.decode()
    assert "checkpoint_sidecar_prune_eligible_namespaces 1.0" in text
    assert "checkpoint_sidecar_prune_pruned_namespaces 1.0" in text
    assert "checkpoint_sidecar_prune_last_success_timestamp_seconds " in text


@pytest.mark.process
async def test_prune_refuses_a_prefix_inside_a_namespace(make_store, store_place, tmp_path):
    store = await make_store("live1")
    data = b"paused workflow"
    await store.put("state/c.json", data, ObjectMeta.of(data, 1, 0o600, version=1))  # a root named without a dot
    await put_marker(store, "live1", heartbeat=time.time(), interval=900)
    before = await keys_below(make_store, "live1")
    r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--force", cwd=tmp_path,
                                                       env=cli_env(store_place, SIDECAR_PREFIX="live1/state")))
    assert r.returncode == 2, r.stderr
    assert "inside the namespace 'live1'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert await keys_below(make_store, "live1") == before


@pytest.mark.process
async def test_a_bad_pushgateway_is_refused_before_anything_is_pruned(make_store, store_place, tmp_path):
    store = await make_store("s1")
    await seed(store, "s1", points=0)
    await put_marker(store, "s1", heartbeat=0, interval=900)
    before = await keys_below(make_store, "s1")
    r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--force", "--pushgateway",
                                                       "ftp://ops:HUNTER2-SECRET@127.0.0.1:1/", cwd=tmp_path,
                                                       env=cli_env(store_place)))
    assert r.returncode == 2, r.stderr
    assert "HUNTER2" not in r.stderr + r.stdout
    assert await keys_below(make_store, "s1") == before


def _backend(store_place) -> str:
    return "directory" if "://" not in store_place[0] else "azure"


async def _plant_what_prune_cannot_delete(store_place) -> None:
    """In namespace ``s1``: on Azure a blob named ``s1/.checkpoints/a//b`` (no store key can name
    it); on the directory store a directory standing where a nested namespace's owner marker goes."""
    url, creds = store_place
    if _backend(store_place) == "directory":
        where = Path(url) / "s1" / "sub" / ".sidecar" / "owner"
        where.mkdir(parents=True)
        (where / "x").write_bytes(b"not a marker")
        return
    from azure.storage.blob.aio import BlobServiceClient

    async with BlobServiceClient.from_connection_string(creds["AZURE_STORAGE_CONNECTION_STRING"]) as svc:
        await svc.get_container_client(url.rstrip("/").rsplit("/", 1)[1]).upload_blob("s1/.checkpoints/a//b", b"x")


async def test_a_namespace_holding_what_prune_cannot_delete_is_refused_untouched(make_store, store_place, tmp_path):
    store = await make_store("s1")
    await seed(store, "s1", points=1)
    await put_marker(store, "s1", heartbeat=0, interval=900)  # released: eligible
    await _plant_what_prune_cannot_delete(store_place)
    marker_before = await store.get(OWNER_KEY)
    before = await keys_below(make_store, "s1")
    r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--force", cwd=tmp_path,
                                                       env=cli_env(store_place)))
    assert r.returncode == 3, r.stdout + r.stderr
    marker_after = await store.get(OWNER_KEY)
    assert marker_after[0] == marker_before[0] and marker_after[1].version == marker_before[1].version, \
        f"the marker changed: {marker_after[0]!r}"
    assert await keys_below(make_store, "s1") == before
    refused = [x for x in r.stdout.splitlines() if x.startswith("failed s1:")]
    assert len(refused) == 1 and "refusing to prune it" in refused[0] and "nothing was changed" in refused[0], r.stdout
    listed = await anyio.to_thread.run_sync(lambda: run_cli("sessions", "--json", cwd=tmp_path,
                                                            env=cli_env(store_place)))
    owners = {row["namespace"]: row["owner"] for row in map(json.loads, listed.stdout.splitlines())}
    assert owners["s1"] == "released", owners  # never left "pruning"


def _read_only(store_place, tmp_path) -> tuple[str, dict[str, str], tuple[str, ...]]:
    """The store seen read-only: a read-only bind mount of the directory (in a mount namespace
    of the CLI's own), or a SAS with read and list permissions only."""
    url, creds = store_place
    if _backend(store_place) == "directory":
        script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
        probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, url,
                                "touch", f"{url}/.probe"], capture_output=True, text=True) \
            if shutil.which("unshare") else None
        if probe is None or "Read-only" not in probe.stderr:
            pytest.skip("needs unshare --user --mount and a read-only bind mount")
        return url, {}, ("unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, url)
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from tests.azurite import DEV_ACCOUNT, DEV_KEY

    container = url.rstrip("/").rsplit("/", 1)[1]
    sas = generate_container_sas(DEV_ACCOUNT, container, account_key=DEV_KEY,
                                 permission=ContainerSasPermissions(read=True, list=True),
                                 expiry=datetime.now(timezone.utc) + timedelta(hours=1))
    return f"{url}?{sas}", {}, ()


async def test_a_dry_run_only_reads_and_works_on_a_read_only_store(make_store, store_place, tmp_path):
    store = await make_store("s1")
    await seed(store, "s1", points=1)
    await put_marker(store, "s1", heartbeat=0, interval=900)
    before = await keys_below(make_store, "s1")
    url, creds, wrap = _read_only(store_place, tmp_path)
    env = {k: v for k, v in cli_env(store_place).items() if not k.startswith("AZURE_")}
    env.update({"SIDECAR_STORE": url, **creds})
    r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--force", "--dry-run", cwd=tmp_path,
                                                       env=env, wrap=wrap))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "would prune s1 (" in r.stdout and "nothing deleted" in r.stdout, r.stdout
    assert await keys_below(make_store, "s1") == before
    wet = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--force", cwd=tmp_path, env=env,
                                                         wrap=wrap))
    assert wet.returncode != 0 and await keys_below(make_store, "s1") == before  # a real prune cannot write there


@pytest.mark.process
async def test_prune_of_a_store_that_is_not_there_says_so(store_place, tmp_path):
    url = store_place[0] if _backend(store_place) == "azure" else str(tmp_path / "no-such-store")
    said = {}
    for command in (("prune", "--older-than", "0s", "--force"), ("prune", "--older-than", "0s", "--force", "--dry-run"),
                    ("sessions",)):
        r = await anyio.to_thread.run_sync(lambda c=command: run_cli(*c, cwd=tmp_path,
                                                                     env=cli_env((url, store_place[1]))))
        assert r.returncode == 1, (command, r.stdout, r.stderr)
        errors = r.stderr.strip().splitlines()
        assert len(errors) == 1 and "is not there: check SIDECAR_STORE" in errors[0], (command, r.stderr)
        assert "pruned 0" not in r.stdout
        said[command[-1]] = errors[0]
    assert said["--force"] == said["--dry-run"]  # the dry run and the real prune: one answer, one code
    if _backend(store_place) == "directory":
        assert not Path(url).exists()


@pytest.mark.process
async def test_prune_covers_every_session_whatever_the_session_id_says(make_store, store_place, tmp_path):
    for name in ("s1", "s2"):
        store = await make_store(f"agents/approvals/{name}")
        await seed(store, name, points=0)
        await put_marker(store, name, heartbeat=0, interval=900)
    env = cli_env(store_place, SIDECAR_PREFIX="agents", FOUNDRY_AGENT_NAME="approvals", **{SESSION: "s1"})
    listed = await anyio.to_thread.run_sync(lambda: run_cli("sessions", "--json", cwd=tmp_path, env=env))
    assert listed.returncode == 0, listed.stderr
    assert sorted(json.loads(x)["namespace"] for x in listed.stdout.splitlines()) == [
        "agents/approvals/s1", "agents/approvals/s2"]
    r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--force", cwd=tmp_path, env=env))
    assert r.returncode == 0, r.stderr
    assert "pruned 2 namespaces" in r.stdout.splitlines()[-1], r.stdout
    said = [x for x in r.stderr.splitlines() if "ignored" in x]
    assert len(said) == 1 and SESSION in said[0] and "'agents'" in said[0], r.stderr
    assert await keys_below(make_store, "agents") == []


async def test_a_store_that_refuses_deletes_is_refused_before_anything_is_marked(make_store, store_place, tmp_path):
    """A SAS that may write (the marker) but not delete would leave the namespace ``deleting``
    for good: prune tries one delete of a missing key first and refuses, the marker untouched."""
    if _backend(store_place) == "directory":
        pytest.skip("a SAS's permissions: the directory store deletes wherever it may write")
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from tests.azurite import DEV_ACCOUNT, DEV_KEY

    store = await make_store("s1")
    await seed(store, "s1", points=1)
    await put_marker(store, "s1", heartbeat=0, interval=900)  # released: eligible
    marker_before = await store.get(OWNER_KEY)
    before = await keys_below(make_store, "s1")
    url = store_place[0]
    sas = generate_container_sas(DEV_ACCOUNT, url.rstrip("/").rsplit("/", 1)[1], account_key=DEV_KEY,
                                 permission=ContainerSasPermissions(read=True, add=True, create=True, write=True,
                                                                    list=True),
                                 expiry=datetime.now(timezone.utc) + timedelta(hours=1))
    env = {k: v for k, v in cli_env(store_place).items() if not k.startswith("AZURE_")}
    env["SIDECAR_STORE"] = f"{url}?{sas}"
    r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--force", cwd=tmp_path, env=env))
    assert r.returncode == 3, r.stdout + r.stderr
    refused = [x for x in r.stdout.splitlines() if x.startswith("failed s1:")]
    assert len(refused) == 1 and "refuses to delete" in refused[0] and "nothing was changed" in refused[0], r.stdout
    assert "sig=" not in r.stdout + r.stderr  # the SAS never shown
    marker_after = await store.get(OWNER_KEY)
    assert (marker_after[0], marker_after[1].version) == (marker_before[0], marker_before[1].version)
    assert await keys_below(make_store, "s1") == before


class _FailingDeletes(_Fresh):
    """Deletes of the namespace's objects fail (after prune's probe passed): a store gone bad mid-prune."""

    async def delete(self, key: str) -> None:
        from sidecar.ops.pruner import DELETE_PROBE
        from sidecar.store.base import StoreError

        if key != DELETE_PROBE:
            raise StoreError(f"deleting {key!r} failed: the store broke")
        await self.store.delete(key)


async def test_deletes_failing_mid_prune_fail_that_namespace_with_one_reason(make_store):
    from sidecar.ops.pruner import FAILED

    store = await make_store("s1")
    await seed(store, "s1", points=2)
    await put_marker(store, "s1", heartbeat=0, interval=900)
    pruner = Pruner(lambda ns: _FailingDeletes(make_store, ns), time.time, 0.05, 0.0, 0.0, 60.0)
    results = [await pruner.prune(ns) for ns in [n async for n in walk(await make_store(), 60.0)]]
    assert [(r.namespace, r.outcome) for r in results] == [("s1", FAILED)]
    assert "the store broke" in results[0].why and "Group" not in results[0].why


def _prune_store_for(store_place, monkeypatch):
    """prune's own factory of a namespace's store (:func:`sidecar.ops.prune._store_for`), on this place."""
    from functools import partial
    from types import SimpleNamespace

    from sidecar.ops import prune

    url, creds = store_place
    for k, v in creds.items():
        monkeypatch.setenv(k, v)
    return partial(prune._store_for, SimpleNamespace(store_url=url), "")


async def _store_is_there(store_place) -> bool:
    url, creds = store_place
    if _backend(store_place) == "directory":
        return Path(url).exists()
    from azure.storage.blob.aio import BlobServiceClient

    async with BlobServiceClient.from_connection_string(creds["AZURE_STORAGE_CONNECTION_STRING"]) as svc:
        return await svc.get_container_client(url.rstrip("/").rsplit("/", 1)[1]).exists()


async def _remove_store(store_place) -> None:
    url, creds = store_place
    if _backend(store_place) == "directory":
        shutil.rmtree(url)
        return
    from azure.storage.blob.aio import BlobServiceClient

    async with BlobServiceClient.from_connection_string(creds["AZURE_STORAGE_CONNECTION_STRING"]) as svc:
        await svc.delete_container(url.rstrip("/").rsplit("/", 1)[1])
    with anyio.fail_after(30):  # Azure deletes a container in the background
        while await _store_is_there(store_place):
            await anyio.sleep(0.1)


async def test_a_namespace_pruned_since_it_was_listed_is_skipped_untouched(make_store, store_place, monkeypatch):
    """Two prunes at once on one store: the second reaches a namespace it listed after the first
    pruned it. It must not mark the namespace again (a marker written into a namespace that is
    gone, counted as pruned twice)."""
    from sidecar.ops.pruner import PRUNED

    for name in ("s1", "s2"):
        store = await make_store(name)
        await seed(store, name, points=1)
        await put_marker(store, name, heartbeat=0, interval=900)
    listed = [n async for n in walk(await make_store(), 60.0)]
    store_for = _prune_store_for(store_place, monkeypatch)
    first = Pruner(store_for, time.time, 0.05, 0.0, 0.0, 60.0)
    assert [(await first.prune(ns)).outcome for ns in listed] == [PRUNED, PRUNED]
    second = Pruner(store_for, time.time, 0.05, 0.0, 0.0, 60.0)
    results = [await second.prune(ns) for ns in listed]
    assert sorted((r.namespace, r.outcome) for r in results) == [("s1", SKIPPED), ("s2", SKIPPED)], results
    assert all("nothing was changed" in r.why for r in results), results
    assert await keys_below(make_store, "") == []


async def test_a_store_deleted_mid_prune_is_never_made_again(make_store, store_place, monkeypatch):
    """The container (or the store's directory) deleted while prune runs: the namespaces left
    fail or are skipped, none is reported pruned, and prune creates no store."""
    from sidecar.ops.pruner import PRUNED

    for name in ("s1", "s2"):
        store = await make_store(name)
        await seed(store, name, points=1)
        await put_marker(store, name, heartbeat=0, interval=900)
    listed = [n async for n in walk(await make_store(), 60.0)]

    deleted: list[str] = []

    async def delete_the_store(namespace: str) -> None:  # once the first namespace is marked pending
        if not deleted:
            deleted.append(namespace)
            await _remove_store(store_place)

    pruner = Pruner(_prune_store_for(store_place, monkeypatch), time.time, 0.05, 0.0, 0.0, 60.0,
                    on_pending=delete_the_store)
    results = [await pruner.prune(ns) for ns in listed]
    assert sorted(r.namespace for r in results) == ["s1", "s2"] and len(deleted) == 1
    assert not [r for r in results if r.outcome == PRUNED], results
    assert not await _store_is_there(store_place), "prune made the store again"


class _ListingBreaks:
    """A top store whose listing fails after its first object (a container deleted mid-walk)."""

    def __init__(self, store) -> None:
        self.store = store

    async def list(self, prefix: str = ""):
        from sidecar.store.base import StoreError

        async for info in self.store.list(prefix):
            yield info
            raise StoreError("listing failed: the container does not exist")

    def __getattr__(self, name: str):
        return getattr(self.store, name)


async def test_a_listing_failing_mid_prune_is_one_store_error(make_store):
    """prune's walk failing part way is the store's failure (one line, exit 1), never an
    exception group that the CLI reports as a bug."""
    from sidecar.ops import prune
    from sidecar.ops.namespaces import StoreClock
    from sidecar.store.base import StoreError

    store = await make_store("s1")
    await seed(store, "s1", points=1)
    await put_marker(store, "s1", heartbeat=0, interval=900)
    top = _ListingBreaks(await make_store())
    pruner = Pruner(lambda ns: _fresh(make_store, ns), time.time, 0.05, 0.0, 0.0, 60.0)
    with pytest.raises(StoreError, match="the container does not exist"):
        await prune._run(top, pruner, await StoreClock.of(top), prune.Tally(False), "")


async def test_a_store_that_lists_but_cannot_read_is_one_line(make_store, store_place, tmp_path):
    """A SAS with list permission only: sessions and prune (dry run or not) say why in one line,
    exit 1, without the SAS."""
    if _backend(store_place) == "directory":
        pytest.skip("a SAS's permissions (the directory store reads whatever it lists, as root)")
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from tests.azurite import DEV_ACCOUNT, DEV_KEY

    store = await make_store("s1")
    await seed(store, "s1", points=1)
    await put_marker(store, "s1", heartbeat=0, interval=900)
    before = await keys_below(make_store, "s1")
    url = store_place[0]
    sas = generate_container_sas(DEV_ACCOUNT, url.rstrip("/").rsplit("/", 1)[1], account_key=DEV_KEY,
                                 permission=ContainerSasPermissions(list=True),
                                 expiry=datetime.now(timezone.utc) + timedelta(hours=1))
    env = {k: v for k, v in cli_env(store_place).items() if not k.startswith("AZURE_")}
    env["SIDECAR_STORE"] = f"{url}?{sas}"
    for command in (("sessions",), ("prune", "--older-than", "0s", "--force", "--dry-run"),
                    ("prune", "--older-than", "0s", "--force")):
        r = await anyio.to_thread.run_sync(lambda c=command: run_cli(*c, cwd=tmp_path, env=env))
        assert r.returncode == 1, (command, r.stdout, r.stderr)
        errors = r.stderr.strip().splitlines()
        assert len(errors) == 1 and "permission denied" in errors[0], (command, r.stderr)
        assert "unexpected" not in errors[0] and "Group" not in errors[0], (command, r.stderr)
        assert "sig=" not in r.stdout + r.stderr
    assert await keys_below(make_store, "s1") == before


@pytest.mark.process
async def test_a_prefix_with_nothing_below_it_is_empty(make_store, store_place, tmp_path):
    """``SIDECAR_PREFIX`` naming a folder not made yet in an existing store (a CronJob set up
    before the first session): nothing to prune, exit 0, and nothing made there; the store's
    clock is read where the folder would be made, never refused as unreadable."""
    store = await make_store("elsewhere/s1")
    await seed(store, "s1", points=0)
    await put_marker(store, "s1", heartbeat=0, interval=900)
    env = cli_env(store_place, SIDECAR_PREFIX="agents")
    for command in (("prune", "--older-than", "0s", "--force"), ("prune", "--older-than", "0s", "--force", "--dry-run"),
                    ("sessions",)):
        r = await anyio.to_thread.run_sync(lambda c=command: run_cli(*c, cwd=tmp_path, env=env))
        assert r.returncode == 0, (command, r.stdout, r.stderr)
        # a real prune reads the store's clock there; one that only reads says it uses this machine's
        assert ("store_clock_local" in r.stderr) == (command[-1] != "--force" and _backend(store_place) == "directory")
        assert "cannot be read" not in r.stderr, (command, r.stderr)
    assert "pruned 0 namespaces" in r.stdout or "NAMESPACE" in r.stdout
    if _backend(store_place) == "directory":
        assert not (Path(store_place[0]) / "agents").exists()
    assert await keys_below(make_store, "agents") == []
    assert len(await keys_below(make_store, "elsewhere")) == 3


@pytest.mark.parametrize("leased", [".checkpoints/b.json", OWNER_KEY])
async def test_a_namespace_holding_a_leased_blob_is_refused_untouched(make_store, store_place, tmp_path, leased):
    """A blob another client holds a lease on cannot be deleted (412 LeaseIdMissing): prune would
    mark the namespace, delete the rest and stay ``deleting`` for as long as the lease. It is seen
    in the listing and refused before anything changes. A leased owner marker too: it cannot be
    marked, and the failure said "will retry" though nothing retried it (issue #34, item 6)."""
    if _backend(store_place) == "directory":
        pytest.skip("blob leases: Azure only")
    from azure.storage.blob.aio import BlobServiceClient

    store = await make_store("s1")
    await seed(store, "s1", points=1)
    await put_marker(store, "s1", heartbeat=0, interval=900)  # released: eligible
    url, creds = store_place
    async with BlobServiceClient.from_connection_string(creds["AZURE_STORAGE_CONNECTION_STRING"]) as svc:
        blob = svc.get_container_client(url.rstrip("/").rsplit("/", 1)[1]).get_blob_client(f"s1/{leased}")
        lease = await blob.acquire_lease(-1)
        marker_before = await store.get(OWNER_KEY)
        before = await keys_below(make_store, "s1")
        r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--force", cwd=tmp_path,
                                                           env=cli_env(store_place)))
        assert r.returncode == 3, r.stdout + r.stderr
        refused = [x for x in r.stdout.splitlines() if x.startswith("failed s1:")]
        assert len(refused) == 1 and "leased" in refused[0] and "nothing was changed" in refused[0], r.stdout
        assert "will retry" not in r.stdout
        marker_after = await store.get(OWNER_KEY)
        assert (marker_after[0], marker_after[1].version) == (marker_before[0], marker_before[1].version)
        assert await keys_below(make_store, "s1") == before
        await lease.release()
    r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--force", cwd=tmp_path,
                                                       env=cli_env(store_place)))
    assert r.returncode == 0 and "pruned s1 (" in r.stdout, r.stdout + r.stderr
    assert await keys_below(make_store, "s1") == []


# -- durations that delete carry a unit (issue #34, item 2) ---------------------------------------

async def _cli(monkeypatch, capsys, store_place, *argv: str, **variables: str) -> tuple[int, str, str]:
    """``checkpoint-sidecar *argv`` in process (its own event loop, in a thread), with the store's
    variables (and ``variables``)."""
    from sidecar.cli import main

    url, creds = store_place
    for k in [k for k in __import__("os").environ if k.startswith("SIDECAR_") or k.startswith("FOUNDRY_")]:
        monkeypatch.delenv(k)
    for k, v in {**creds, "SIDECAR_STORE": url, "SIDECAR_FENCE_WINDOW": "0.3", "SIDECAR_FENCE_MARGIN": "0",
                 "SIDECAR_LOG_FORMAT": "json", **variables}.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    def command() -> int:
        try:
            return main(list(argv))
        except SystemExit as e:  # a usage error
            return int(e.code or 0)

    code = await anyio.to_thread.run_sync(command)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, variables", [
    (("prune", "--older-than", "7"), {}),
    (("prune", "--older-than", "7", "--dry-run"), {}),
    (("prune", "--older-than", "7", "--force"), {}),
    (("prune", "--older-than", "7d", "--live-within", "60"), {}),
    (("prune", "--dry-run"), {"SIDECAR_OLDER_THAN": "7"}),
    (("sessions",), {"SIDECAR_LIVE_WITHIN": "3600"}),
])
async def test_a_duration_without_its_unit_is_refused_before_anything_is_read(make_store, store_place, monkeypatch,
                                                                              capsys, argv, variables):
    """``prune --older-than 7`` meant seven seconds, on a command that deletes for good."""
    store = await make_store("s1")
    await seed(store, "s1", points=0)
    await put_marker(store, "s1", heartbeat=0, interval=900)  # released: eligible at any age
    before = await keys_below(make_store, "s1")
    code, out, err = await _cli(monkeypatch, capsys, store_place, *argv, **variables)
    assert code == 2, (out, err)
    [line] = err.strip().splitlines()
    assert "has no unit" in line and "config error: SIDECAR_" in line, line
    assert out == ""
    assert await keys_below(make_store, "s1") == before


async def test_older_than_below_an_hour_needs_force(make_store, store_place, monkeypatch, capsys):
    store = await make_store("s1")
    await seed(store, "s1", points=0)
    await put_marker(store, "s1", heartbeat=0, interval=900)
    before = await keys_below(make_store, "s1")
    for argv in (("--older-than", "30m"), ("--older-than", "0s", "--dry-run")):
        code, out, err = await _cli(monkeypatch, capsys, store_place, "prune", *argv)
        assert code == 2, (argv, out, err)
        [line] = err.strip().splitlines()
        assert "is below 1h" in line, line
        # the hint is the whole command, pasteable: store, prefix, flags (issue #34, item 6)
        assert "SIDECAR_STORE=" in line and " SIDECAR_PREFIX='' SIDECAR_SESSION_NAMESPACE=off " in line, line
        assert line.endswith(f"checkpoint-sidecar prune {' '.join(argv)} --force"), line
    code, out, err = await _cli(monkeypatch, capsys, store_place, "prune", "--dry-run", "--force",
                          SIDECAR_OLDER_THAN="0s", SIDECAR_LIVE_WITHIN="2h")  # the variables, too
    assert code == 0 and "would prune s1 (" in out, (out, err)
    assert await keys_below(make_store, "s1") == before


# -- prune fails per namespace, never per run (issue #34, item 4) ---------------------------------

class _Undeletable(_Fresh):
    """A namespace's store holding an object the store will not delete: its delete raises what
    a store may raise that is no StoreError (a permission error from the filesystem)."""

    async def delete(self, key: str) -> None:
        if key.endswith("b.json"):
            raise PermissionError(1, "Operation not permitted", key)
        await self.store.delete(key)


async def test_an_undeletable_object_fails_its_namespace_alone_and_the_next_prune_finishes_it(
        make_store, store_place, monkeypatch, capsys):
    """One namespace whose delete fails: one ``failed`` line, exit 3, the others pruned, never
    ``unexpected ExceptionGroup``. It is left ``deleting`` (a prune's marker): the next prune
    finishes it at once, without waiting --live-within (1h), while a live namespace beside it
    keeps every object."""
    from sidecar.ops import prune

    for name in ("s1", "s2", "s3"):
        store = await make_store(name)
        await seed(store, name, points=1)
        await put_marker(store, name, heartbeat=0, interval=900)  # released: eligible
    live = await make_store("live")
    await seed(live, "live", points=1)
    await put_marker(live, "live", heartbeat=time.time(), interval=900)
    live_before = await keys_below(make_store, "live")
    real = prune._store_for

    def store_for(settings, prefix: str, namespace: str):
        store = real(settings, prefix, namespace)
        if namespace != "s2":
            return store
        wrapped = _Undeletable(None, namespace)
        wrapped.store = store
        wrapped.open = store.open  # type: ignore[method-assign]
        return wrapped

    monkeypatch.setattr(prune, "_store_for", store_for)
    code, out, err = await _cli(monkeypatch, capsys, store_place, "prune", "--older-than", "0s", "--force")
    assert code == 3, (out, err)
    assert "unexpected" not in err and "Group" not in out + err, err
    failed = [x for x in out.splitlines() if x.startswith("failed ")]
    assert len(failed) == 1 and failed[0].startswith("failed s2: PermissionError"), out
    assert sorted(x.split(" (")[0] for x in out.splitlines() if x.startswith("pruned ")) == ["pruned s1", "pruned s3"]
    assert await keys_below(make_store, "s1") == [] and await keys_below(make_store, "s3") == []
    marker = await read_marker(await make_store("s2"))
    assert marker["prune"] == {"phase": "deleting"} and marker["owner"].startswith("prune:"), marker

    monkeypatch.setattr(prune, "_store_for", real)
    code, out, err = await _cli(monkeypatch, capsys, store_place, "prune", "--older-than", "7d")  # --live-within: 1h
    assert code == 0, (out, err)
    assert [x.split(" (")[0] for x in out.splitlines() if not x.startswith("prune:")] == ["pruned s2"], out
    assert await keys_below(make_store, "s2") == []
    assert await keys_below(make_store, "live") == live_before


async def test_a_deleting_marker_that_proves_no_prune_waits_out_live_within(make_store):
    """Only a marker a prune wrote (owner ``prune:<id>``, stored at the stamp it records) is
    finished at once; a ``deleting`` phase under another owner, or copied at another version,
    still waits --live-within."""
    from sidecar.ops.pruner import PRUNED

    for name, owner, version in (("copied", "prune:x", 3 << 32), ("foreign", "someone", 7 << 32),
                                 ("proven", "prune:y", 7 << 32)):
        store = await make_store(name)
        await seed(store, name, points=0)
        data = json.dumps({"generation": 7 << 32, "owner": owner, "heartbeat": 1, "identity": ident(name),
                           "prune": {"phase": "deleting"}}).encode()
        await store.put(OWNER_KEY, data, ObjectMeta.of(data, version, 0o600, version=version))
    now = await (await make_store()).now()  # the store's clock (the memory store's is a fake one)
    pruner = Pruner(lambda ns: _fresh(make_store, ns), lambda: now, 0.05, 0.0, 7 * 86400.0, 3600.0)
    listed = [n async for n in walk(await make_store(), 3600.0)]
    results = {r.namespace: r for r in [await pruner.prune(ns) for ns in listed]}
    assert results["proven"].outcome == PRUNED, results
    assert results["copied"].outcome == SKIPPED and results["foreign"].outcome == SKIPPED, results
    assert len(await keys_below(make_store, "copied")) == 3 and len(await keys_below(make_store, "foreign")) == 3


@pytest.mark.process
async def test_a_prune_into_a_closed_pipe_prunes_every_namespace_and_says_one_line(make_store, store_place, tmp_path):
    """``prune | head -1`` once head has gone: it was "unexpected ExceptionGroup: BrokenPipeError"
    part way, namespaces left half-deleted (outside tester, round 2). The prune goes on to its
    end: every eligible namespace pruned, one line naming the lost output and the summary."""
    import subprocess

    from support import sidecar_cmd

    names = [f"s{i}" for i in range(6)]
    for name in names:
        store = await make_store(f"agents/{name}")
        await seed(store, name, points=0)
        await put_marker(store, name, heartbeat=0, interval=900)
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first line
    try:
        p = await anyio.to_thread.run_sync(lambda: subprocess.run(
            sidecar_cmd("prune", "--older-than", "0s", "--force"), cwd=tmp_path,
            env=cli_env(store_place, SIDECAR_PREFIX="agents"), stdout=w, stderr=subprocess.PIPE, text=True, timeout=60))
    finally:
        os.close(w)
    assert p.returncode == 1, p.stderr
    [line] = p.stderr.strip().splitlines()
    assert "cannot write the list: Broken pipe; the prune went on to its end: prune: pruned 6 namespaces" in line, line
    for name in names:
        assert await keys_below(make_store, f"agents/{name}") == [], name
