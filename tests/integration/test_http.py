"""/livez, /readyz, /metrics and ``probe`` against the real ``sync``/``run`` processes (127.0.0.1 only)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar import http as sidecar_http
from sidecar import metrics as sidecar_metrics
from sidecar.config import load
from sidecar.store.base import ObjectMeta
from sidecar.store.directory import DirectoryStore
from support import REPO, Sidecar, metric_values, run_cli, sidecar_env, store_tree, wait_for, write_atomic

FAKE_KEY = "ZmFrZS1rZXktbmV2ZXItc2hvdy10aGlzLXZhbHVlLWFueXdoZXJlPT0="
FAKE_CONN = ("DefaultEndpointsProtocol=https;AccountName=fakeacct;"
             f"AccountKey={FAKE_KEY};EndpointSuffix=core.windows.net")


# -- helpers ------------------------------------------------------------------------------------

def start(work: Path, store: Path, *extra: str, env: dict[str, str] | None = None,
          wait: str | None = "ready") -> tuple[Sidecar, str]:
    """``sync`` with the listener on a kernel-chosen port; (process, "http://127.0.0.1:PORT")."""
    sc = Sidecar(work, "sync", "--store", str(store), "--http-addr", "127.0.0.1:0", *extra, env=env)
    addr = sc.wait_event("http_listening")["addr"]
    assert addr.startswith("127.0.0.1:"), addr
    if wait:
        sc.wait_event(wait)
    return sc, f"http://{addr}"


def get(base: str, path: str, method: str = "GET", **kw) -> httpx.Response:
    return httpx.request(method, base + path, timeout=5, **kw)


def raw(base: str, request: bytes, timeout: float = 5) -> bytes:
    """Send ``request`` as is; everything the server answers before closing."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def probe_cli(base: str, what: str, cwd: Path, timeout: float = 2):
    return run_cli("probe", what, "--http-addr", base.removeprefix("http://"), "--timeout", str(timeout),
                   cwd=cwd, timeout=30)


def probe_inprocess(addr: str, what: str, capsys) -> tuple[int, str]:
    """The probe function the CLI calls, without a process start (for short windows)."""
    settings, _ = load({"http_addr": addr})
    code = sidecar_http.probe(settings, what, 2.0)
    return code, capsys.readouterr().out.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_store(store: Path, n: int, size: int = 512) -> None:
    """``n`` stored files of ``size`` bytes: one written by the directory store's own put(), the
    rest hard links to its data and metadata files (same bytes, same recorded mtime; instant)."""
    first = ".checkpoints/ctx0/00000.json"

    async def put() -> None:
        st = DirectoryStore(str(store))
        await st.open()
        data = os.urandom(size)
        await st.put(first, data, ObjectMeta.of(data, 1_700_000_000_000_000_000, 0o600))

    anyio.run(put)
    data_path, meta_path = store / first, store / ".sidecar-meta" / (first + ".json")
    assert data_path.is_file() and meta_path.is_file()
    for i in range(1, n):
        key = f".checkpoints/ctx{i % 25}/{i:05}.json"
        for src, dst in ((data_path, store / key), (meta_path, store / ".sidecar-meta" / (key + ".json"))):
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)


# -- readiness through a slow restore ------------------------------------------------------------

def test_readyz_is_503_while_the_restore_is_held_then_200(tmp_path, capsys):
    """In process: the store answers no download until the test has seen the restore in progress
    (a gate, not a slow store), so every answer during the restore is asserted, whatever the
    machine's speed."""
    from sidecar.lifecycle import Lifecycle, Shutdown
    from tests.azurite import free_port

    store_dir, work = tmp_path / "store", tmp_path / "work"
    work.mkdir()
    n = 20
    seed_store(store_dir, n)
    gate, asked = anyio.Event(), anyio.Event()

    class Held(DirectoryStore):
        async def get(self, key):
            if key.startswith(".checkpoints/"):
                asked.set()
                await gate.wait()
            return await super().get(key)

        async def get_stream(self, key, read_ahead=0):
            if key.startswith(".checkpoints/"):
                asked.set()
                await gate.wait()
            return await super().get_stream(key, read_ahead)

    port = free_port()
    settings, roots = load({"store": str(store_dir), "http_addr": f"127.0.0.1:{port}", "concurrency": 1},
                           cwd=str(work), env=sidecar_env())
    base = f"http://127.0.0.1:{port}"

    class InProcess(Lifecycle):
        def open_store(self):
            self.store = Held(str(store_dir))
            return self.store

    shutdown = Shutdown()
    codes: list[int] = []

    def counted(m: dict, name: str) -> float:  # the registry is the process's: other tests count too
        return m.get(name, 0) - before.get(name, 0)

    from prometheus_client import generate_latest

    # built now if not yet (counting what earlier tests of this process restored), then read
    before = metric_values(generate_latest(sidecar_metrics.REGISTRY).decode())

    async def main() -> None:
        async with anyio.create_task_group() as tg, httpx.AsyncClient(base_url=base, timeout=30) as client:
            async def life() -> None:
                codes.append(await InProcess(settings, roots, shutdown=shutdown).main())

            tg.start_soon(life)
            with anyio.fail_after(30):
                await asked.wait()  # the restore is downloading, and held
            r = await client.get("/readyz")
            assert r.status_code == 503, (r.status_code, r.text)
            assert r.text == "not ready: restoring state from the store\n"
            assert r.headers["content-type"].startswith("text/plain")
            live = await client.get("/livez")
            assert live.status_code == 200 and live.text.startswith("live: "), live.text
            m = metric_values((await client.get("/metrics")).text)
            assert m["checkpoint_sidecar_ready"] == 0
            # the probe's exit code agrees with /readyz
            code, out = await anyio.to_thread.run_sync(probe_inprocess, f"127.0.0.1:{port}", "ready", capsys)
            assert code == 1 and out.startswith("not ready: "), out
            code, out = await anyio.to_thread.run_sync(probe_inprocess, f"127.0.0.1:{port}", "live", capsys)
            assert code == 0 and out.startswith("live: ")

            gate.set()
            with anyio.fail_after(60):
                while (r := await client.get("/readyz")).status_code != 200:
                    assert r.status_code == 503 and r.text.startswith("not ready: "), (r.status_code, r.text)
                    await anyio.sleep(0.01)  # a poll's pace
            assert r.text == "ready: restored and mirroring\n"
            assert (await client.get("/livez")).status_code == 200
            m = metric_values((await client.get("/metrics")).text)
            assert counted(m, "checkpoint_sidecar_restored_files_total") == n
            assert counted(m, "checkpoint_sidecar_restored_bytes_total") == n * 512
            assert m["checkpoint_sidecar_restore_duration_seconds"] > 0
            assert m["checkpoint_sidecar_ready"] == 1
            shutdown.trigger()

    anyio.run(main)
    assert codes == [0]
    assert len(list((work / ".checkpoints").rglob("*.json"))) == n

def test_metrics_parse_and_counters_move_without_secrets(work):
    work, store = work
    (work / ".checkpoints").mkdir()  # watched from the start, so changes arrive as watch events
    env = sidecar_env(AZURE_STORAGE_CONNECTION_STRING=FAKE_CONN, SIDECAR_LOG_LEVEL="debug")
    sc, base = start(work, store, env=env)
    try:
        r = get(base, "/metrics")
        assert r.status_code == 200
        ctype = r.headers["content-type"]
        assert ctype.startswith("text/plain; version=") and "charset=utf-8" in ctype
        before = metric_values(r.text)
        assert before["checkpoint_sidecar_uploaded_files_total"] == 0
        assert before["checkpoint_sidecar_pending_paths"] == 0
        assert "checkpoint_sidecar_process_resident_memory_bytes" in before

        payloads = {f"c/{i}.json": os.urandom(100 + i) for i in range(5)}
        for rel, data in payloads.items():
            write_atomic(work / ".checkpoints" / rel, data)
        wait_for(lambda: store_tree(store) == payloads, 10, "the files to be mirrored")

        def counted():
            m = metric_values(get(base, "/metrics").text)
            return m if m["checkpoint_sidecar_uploaded_files_total"] >= 5 else None

        after = wait_for(counted, 10, "uploaded_files_total to count the uploads")
        assert after["checkpoint_sidecar_uploaded_files_total"] == 5
        assert after["checkpoint_sidecar_uploaded_bytes_total"] == sum(len(d) for d in payloads.values())
        assert after["checkpoint_sidecar_write_to_durable_seconds_count"] >= 5
        assert after["checkpoint_sidecar_watch_events_total"] > 0
        assert after["checkpoint_sidecar_last_sync_timestamp_seconds"] > time.time() - 60
        assert after["checkpoint_sidecar_reconciles_total{kind=local}"] >= 1

        # HEAD: the same headers, no body
        h = get(base, "/metrics", "HEAD")
        assert h.status_code == 200 and h.content == b"" and int(h.headers["content-length"]) > 1000

        # the documentation lists every metric the sidecar exposes
        doc = (REPO / "docs" / "OPERATIONS.md").read_text()
        families = {f.name for f in text_string_to_metric_families(get(base, "/metrics").text)}
        undocumented = sorted(f for f in families
                              if f.startswith("checkpoint_sidecar_") and not f.startswith("checkpoint_sidecar_process_")
                              and f not in doc)
        assert not undocumented, f"metrics missing from docs/OPERATIONS.md: {undocumented}"

        for path in ("/metrics", "/readyz", "/livez"):
            body = get(base, path).text
            assert FAKE_KEY not in body and "AccountKey" not in body and "fakeacct" not in body
    finally:
        assert sc.stop() == 0, sc.log()
    assert FAKE_KEY not in sc.log()


# -- the HTTP surface -----------------------------------------------------------------------------

def test_unknown_paths_methods_and_bad_requests(work):
    work, store = work
    sc, base = start(work, store)
    try:
        r = get(base, "/")
        assert r.status_code == 404 and r.headers["connection"] == "close"
        assert get(base, "/ready").status_code == 404
        assert get(base, "/readyz?verbose=1").status_code == 200  # the query is ignored
        for method in ("POST", "PUT", "DELETE", "OPTIONS", "PATCH"):
            r = get(base, "/readyz", method, **({"content": b"x" * 20000} if method in ("POST", "PUT") else {}))
            assert r.status_code == 405, (method, r.status_code)
            assert r.headers["allow"] == "GET, HEAD"
        h = get(base, "/readyz", "HEAD")
        assert h.status_code == 200 and h.content == b""
        assert h.headers["content-length"] == str(len("ready: restored and mirroring\n"))

        assert raw(base, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        assert raw(base, b"GET /readyz HTTP/2.0\r\n\r\n").startswith(b"HTTP/1.1 505 ")
        assert raw(base, b"GET /readyz HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 200 ")
        assert raw(base, b"GET /livez HTTP/1.1\nHost: x\n\n").startswith(b"HTTP/1.1 200 ")  # bare LF
        big = b"GET /readyz HTTP/1.1\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n"
        assert raw(base, big).startswith(b"HTTP/1.1 431 ")
        # a client that leaves before asking does no harm
        socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))).close()

        # clients that connect and say nothing (or dribble) never hold up others, or the sync path
        host, port = "127.0.0.1", int(base.rsplit(":", 1)[1])
        idle = [socket.create_connection((host, port)) for _ in range(10)]
        try:
            idle[0].sendall(b"GET /rea")
            # answered at all: a server serving one client at a time would wait for these forever
            assert get(base, "/livez").status_code == 200
            write_atomic(work / ".checkpoints" / "x.json", b"still mirroring")
            wait_for(lambda: store_tree(store) == {"x.json": b"still mirroring"}, 10, "upload while clients idle")
        finally:
            for s in idle:
                s.close()
        assert get(base, "/readyz").status_code == 200
    finally:
        assert sc.stop() == 0, sc.log()


def test_probe_exit_codes(work, capsys):
    work, store = work
    port = free_port()
    p = probe_cli(f"http://127.0.0.1:{port}", "ready", work, timeout=1)  # nothing listening
    assert p.returncode == 1 and p.stdout.startswith("not ready: cannot reach the sidecar at http://127.0.0.1:")
    p = run_cli("probe", "live", "--http-addr", "", cwd=work)
    assert p.returncode == 2 and "SIDECAR_HTTP_ADDR" in p.stderr

    # a server that never answers: the probe gives up after --timeout
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        p = probe_cli(f"http://127.0.0.1:{mute.getsockname()[1]}", "live", work, timeout=0.5)
        assert p.returncode == 1 and "no answer" in p.stdout, p.stdout  # it gave up: it never answers

    sc, base = start(work, store)
    try:
        port = base.rsplit(":", 1)[1]
        # a listener configured on every interface is probed on loopback
        code, out = probe_inprocess(f"0.0.0.0:{port}", "ready", capsys)
        assert (code, out) == (0, "ready: restored and mirroring")
        env = sidecar_env(SIDECAR_HTTP_ADDR=f"127.0.0.1:{port}")  # the environment, as in a container
        p = run_cli("probe", "ready", cwd=work, env=env)
        assert (p.returncode, p.stdout.strip()) == (0, "ready: restored and mirroring"), p.stderr
    finally:
        assert sc.stop() == 0, sc.log()


def test_readyz_is_503_while_shutting_down(work):
    work, store = work
    sc, base = start(work, store, "--drain-timeout", "60")
    try:
        write_atomic(work / ".checkpoints" / "a.json", b"first")
        wait_for(lambda: store_tree(store) == {"a.json": b"first"}, 10, "first upload")
        # break the store under the daemon: the root's directory in the store becomes a file
        root_in_store = store / ".checkpoints"
        for p in sorted(root_in_store.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        root_in_store.rmdir()
        root_in_store.write_bytes(b"not a directory")
        write_atomic(work / ".checkpoints" / "b.json", b"cannot be stored")
        sc.wait_event("store_retry")
        assert get(base, "/readyz").status_code == 200  # failing uploads alone do not unready it

        sc.send(signal.SIGTERM)
        r = wait_for(lambda: (r := get(base, "/readyz")).status_code == 503 and r, 10, "/readyz 503 after SIGTERM")
        assert r.text == "not ready: shutting down: flushing pending changes\n"
        assert get(base, "/livez").status_code == 200  # still working: flushing
        p = probe_cli(base, "ready", work)
        assert (p.returncode, p.stdout.strip()) == (1, "not ready: shutting down: flushing pending changes")
        assert probe_cli(base, "live", work).returncode == 0
        assert sc.proc.poll() is None  # still draining (the flush cannot succeed)
    finally:
        rc = sc.stop(signal.SIGTERM)  # the second signal abandons the flush
    assert rc == 75, sc.log()


# -- slow clients ---------------------------------------------------------------------------------

class Slowloris:
    """``n`` connections held open, each sending a request head that never ends; every one the
    server closes is opened again at once. Bounded: at most ``max_opens`` connections in all,
    all closed when the block ends."""

    def __init__(self, base: str, n: int = 500, max_opens: int = 20000) -> None:
        import selectors
        import threading

        host, port = base.removeprefix("http://").rsplit(":", 1)
        self.addr, self.n, self.max_opens = (host, int(port)), n, max_opens
        self.sel = selectors.DefaultSelector()
        self.opened = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> None:
        import selectors

        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(self.addr)
        self.sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)
        self.opened += 1

    def _run(self) -> None:
        import selectors

        for _ in range(self.n):
            self._open()
        while not self.stop.is_set():
            for key, ev in self.sel.select(0.05):
                s = key.fileobj
                if ev & selectors.EVENT_WRITE:  # connected: a head that never ends
                    with contextlib.suppress(OSError):
                        s.send(b"GET /livez HTTP/1.1\r\nHost: x\r\n")
                    self.sel.modify(s, selectors.EVENT_READ)
                    continue
                try:
                    data = s.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # closed by the server: come back
                    self.sel.unregister(s)
                    s.close()
                    if self.opened < self.max_opens:
                        self._open()

    def __enter__(self) -> "Slowloris":
        self.thread.start()
        wait_for(lambda: self.opened >= self.n, 10, f"{self.n} slow connections")
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()


@pytest.mark.faults
def test_probes_answer_under_500_slow_connections(work):
    """Clients that open connections and never finish a request (slowloris) used to fill every
    slot (64) for 5 s each, and /livez failed: the kubelet restarts such a pod. The oldest slow
    connection now makes room for a new one and a request head gets 1 s, so probes are answered."""
    work, store = work
    sc, base = start(work, store)
    try:
        with Slowloris(base, 500) as slow:
            for _ in range(10):
                for path in ("/livez", "/readyz"):
                    r = httpx.get(base + path, timeout=3)
                    assert r.status_code == 200, r.text
            assert slow.opened > 500  # the server did close slow connections
        assert get(base, "/livez").status_code == 200
        assert sc.stop() == 0
    finally:
        sc.kill()


# -- run, and binding -----------------------------------------------------------------------------

def test_run_serves_health_before_the_child_starts(work):
    work, store = work
    port = free_port()
    # the child is the probe itself: it can only pass if /readyz is 200 when the command starts
    r = run_cli("run", "--store", str(store), "--http-addr", f"127.0.0.1:{port}", "--",
                sys.executable, "-m", "sidecar", "probe", "ready", "--http-addr", f"127.0.0.1:{port}", cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "ready: restored and mirroring"


@pytest.mark.parametrize("command", ["sync", "run"])
def test_port_in_use_is_one_line_and_exit_1(work, command):
    work, store = work
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        args = [command, "--store", str(store), "--http-addr", f"127.0.0.1:{port}"]
        if command == "run":
            args += ["--", "touch", str(work / "started")]
        r = run_cli(*args, cwd=work)
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("checkpoint-sidecar: ")]
    assert len(errors) == 1 and "Traceback" not in r.stderr and "unexpected" not in r.stderr, r.stderr
    assert re.search(rf"cannot listen on 127\.0\.0\.1:{port} .*already in use", errors[0]), errors[0]
    assert not (work / "started").exists()
    assert not store.exists() or store_tree(store) == {}
