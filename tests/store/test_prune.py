"""sessions and prune on both stores: 50 namespaces (live, released, stale, with restore points),
listed exactly, only the ended ones pruned and wholly; a namespace claimed between prune's pending
and deleting phases keeps every object; a dry run deletes nothing; a pruned session's recreated
compute (the real ``restore`` process) starts empty and says so; the gauges reach a Pushgateway.
Also the store's clock and its conditional delete."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import anyio
import pytest

from sidecar.fence import OWNER_KEY, Fence, Fenced, Taken, read_marker, take_for_restore
from sidecar.namespaces import walk
from sidecar.pruner import SKIPPED, Pruner
from sidecar.store.base import ObjectMeta
from support import run_cli, sidecar_env

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
    dry = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--live-within", "2s",
                                                         "--dry-run", cwd=tmp_path, env=cli_env(store_place)))
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("would prune agents/_/") == 30 and "nothing deleted" in dry.stdout
    assert len(await keys_below(make_store, "agents")) == 50 * 3 + sum(int(n[1:]) % 3 for n in fifty)

    r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--live-within", "2s",
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

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.got.append((self.command, self.path, body))
        self.send_response(200)
        self.end_headers()

    do_PUT = do_POST  # noqa: N815

    def log_message(self, *args) -> None:
        return None


async def test_prune_pushes_its_gauges(make_store, store_place, tmp_path):
    store = await make_store("s1")
    await seed(store, "s1", points=1)
    await put_marker(store, "s1", heartbeat=0, interval=900)
    server = HTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--pushgateway", url,
                                                           cwd=tmp_path, env=cli_env(store_place)))
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stderr
    method, path, body = _Gateway.got[-1]
    assert method == "POST" and path == "/metrics/job/checkpoint_sidecar_prune"
    text = body.decode()
    assert "checkpoint_sidecar_prune_eligible_namespaces 1.0" in text
    assert "checkpoint_sidecar_prune_pruned_namespaces 1.0" in text
    assert "checkpoint_sidecar_prune_last_success_timestamp_seconds " in text


async def test_prune_refuses_a_prefix_inside_a_namespace(make_store, store_place, tmp_path):
    store = await make_store("live1")
    data = b"paused workflow"
    await store.put("state/c.json", data, ObjectMeta.of(data, 1, 0o600, version=1))  # a root named without a dot
    await put_marker(store, "live1", heartbeat=time.time(), interval=900)
    before = await keys_below(make_store, "live1")
    r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", cwd=tmp_path,
                                                       env=cli_env(store_place, SIDECAR_PREFIX="live1/state")))
    assert r.returncode == 2, r.stderr
    assert "inside the namespace 'live1'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert await keys_below(make_store, "live1") == before


async def test_a_bad_pushgateway_is_refused_before_anything_is_pruned(make_store, store_place, tmp_path):
    store = await make_store("s1")
    await seed(store, "s1", points=0)
    await put_marker(store, "s1", heartbeat=0, interval=900)
    before = await keys_below(make_store, "s1")
    r = await anyio.to_thread.run_sync(lambda: run_cli("prune", "--older-than", "0s", "--pushgateway",
                                                       "ftp://ops:HUNTER2-SECRET@127.0.0.1:1/", cwd=tmp_path,
                                                       env=cli_env(store_place)))
    assert r.returncode == 2, r.stderr
    assert "HUNTER2" not in r.stderr + r.stdout
    assert await keys_below(make_store, "s1") == before
