"""checkpoint-sidecar benchmarks, each measured side by side with its reference in one run.

    .venv/bin/python bench/run.py            # full run (about 10 minutes)
    .venv/bin/python bench/run.py --quick    # smoke: small sizes, seconds (CI keeps it working)
    .venv/bin/python bench/run.py --only latency,burst
    .venv/bin/python bench/run.py --credential identity --only coldstart,restore

``--credential`` picks the credential path every Azure figure runs on (bench/credentials.py):
``key`` (default; a connection string with the account key, plain http) or ``identity`` (managed
identity: an emulated IDENTITY_ENDPOINT, bearer tokens, Azurite over https with --oauth basic).

Installs the sidecar into a fresh virtual environment as the image does (pip install -c
constraints.txt .), starts its own Azurite on 127.0.0.1 and prints one table — figure, the project's value, the
reference measured in the same run, the ratio, the target — and writes it to
bench/out/results.json. Nothing here asserts a time.

Figures:
  latency    a file written atomically into a mirrored root -> the blob stored (sidecar's "uploaded"
             log line, bytes verified after), p50/p99 for 4 KiB and 256 KiB; floor: the raw async
             SDK upload of the same bytes, interleaved.
  burst      1,000 x 16 KiB files appear at once (a directory renamed into the root) -> all
             durable; references: the raw SDK with 16 in flight reading the same files, and
             `rclone copy --transfers 16` of the same tree.
  restore    1,000 files / ~100 MiB in the store -> `checkpoint-sidecar restore` done (verified);
             reference: `rclone copy` down with 16 transfers; and the named stack's floor for the
             same restore (its imports, then the raw SDK's listing and point GET at once).
  footprint  RSS and CPU of an idle `sync` over 60 s (10 s with --quick) with 10,000 files.
  scaling    write -> durable p50 with 1,000 vs 100,000 files under the roots (directory store,
             so the setup takes seconds, not minutes).
  coldstart  launch -> agent host /readiness, bare vs under `checkpoint-sidecar run --` restoring
             20 files / 2 MiB from Azurite.
  points     restore points' stored bytes and requests per hour for a 100 MiB namespace with 1 KiB
             changed a second (bench/points_cost.py: an hour simulated, the real bytes and requests
             counted), next to the bytes the host changed; target: <= 3x those plus a full a day.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas  # noqa: E402
from credentials import Target  # noqa: E402  (bench/credentials.py)
from support import json_lines  # noqa: E402

from tests.azurite import DEV_ACCOUNT, DEV_KEY  # noqa: E402

OUT = REPO / "bench" / "out"
RESULTS: list[dict] = []
CREDENTIAL = ["key"]  # the credential path of the figure being measured
#: The interpreter that runs the sidecar: a virtual environment with the sidecar installed the way
#: the image installs it (see install_sidecar), not the development checkout.
SIDECAR_PY = sys.executable


def sidecar_cmd() -> list[str]:
    """The installed ``checkpoint-sidecar`` command, as the image and the manifests run it."""
    return [str(Path(SIDECAR_PY).parent / "checkpoint-sidecar")]


def install_sidecar(where: Path) -> str:
    """``pip install -c constraints.txt .`` into a fresh virtual environment, as the Dockerfile
    does; its python. The development venv would measure a different program: its editable
    install's import hook and the test tools' ``.pth`` files double the interpreter's start (23 vs
    12 ms), and under this machine's ``PYTHONDONTWRITEBYTECODE=1`` a checkout has no bytecode."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    python = str(where / "bin" / "python")
    r = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c",
                        str(REPO / "constraints.txt"), str(REPO)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench: installing the sidecar failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return python


def pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(p / 100 * (len(v) - 1))))]


def record(figure: str, project: float, reference: float | None, unit: str, target: str, ref_name: str,
           **extra: object) -> None:
    ratio = (project / reference) if reference else None
    RESULTS.append({"figure": figure, "project": round(project, 3),
                    "reference": None if reference is None else round(reference, 3), "reference_name": ref_name,
                    "ratio": None if ratio is None else round(ratio, 2), "unit": unit,
                    "target": target, "credential": CREDENTIAL[0], **extra})
    r = "-" if reference is None else f"{reference:.2f}"
    q = "-" if ratio is None else f"{ratio:.2f}x"
    print(f"  {figure:42} {project:10.2f} {r:>10} {unit:5} {q:>7}   {ref_name} | target: {target}", flush=True)


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class SidecarProc:
    """`checkpoint-sidecar` as a real process; its JSON log lines are read as they arrive."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.lines: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen([*sidecar_cmd(), *args], cwd=cwd, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stderr:
            now = time.perf_counter()
            try:
                self.lines.put((now, json.loads(raw)))
            except ValueError:
                pass

    def wait(self, event: str, path: str | None = None, timeout: float = 120) -> float:
        deadline = time.monotonic() + timeout
        while True:
            try:
                t, e = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no {event} {path or ''} within {timeout}s") from None
            if e.get("event") == event and (path is None or e.get("path") == path):
                return t

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def plain_env() -> dict[str, str]:
    """A sidecar environment with no Azure credential (the directory-store figures)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env.pop("PYTHONPATH", None)  # the installed sidecar, not the checkout
    env.update(SIDECAR_LOG_FORMAT="json", SIDECAR_HTTP_ADDR="")
    return env


# -- figures ----------------------------------------------------------------------------------

async def bench_latency(t: Target, tmp: Path, n: int) -> None:
    work = tmp / "lat"
    (work / ".checkpoints").mkdir(parents=True)
    url = f"{t.url}/lat"
    sc = SidecarProc(["sync", "--store", url, "--log-level", "debug"], work, t.sidecar_env())
    sc.wait("ready", timeout=60)
    async with t.service() as svc:
        container = svc.get_container_client("lat")
        for size in (4096, 256 * 1024):
            side, floor = [], []
            for i in range(n):
                data = os.urandom(size)
                key = f"ctx/{size}-{i}.json"
                t0 = time.perf_counter()
                write_atomic(work / ".checkpoints" / key, data)
                t1 = sc.wait("uploaded", f".checkpoints/{key}")
                side.append(t1 - t0)
                blob = container.get_blob_client(f"floor/{size}-{i}")
                t0 = time.perf_counter()
                await blob.upload_blob(data, overwrite=True)
                floor.append(time.perf_counter() - t0)
            got = await (await container.get_blob_client(f".checkpoints/{key}").download_blob()).readall()
            assert got == data, "stored bytes differ"
            label = f"{size // 1024} KiB"
            p50, f50, p99, f99 = (pct(x, q) * 1e3 for x, q in ((side, 50), (floor, 50), (side, 99), (floor, 99)))
            record(f"latency {label} p50 (write -> durable)", p50, f50, "ms",
                   "p50 within 5 ms of the floor", "raw SDK upload", met=p50 - f50 <= 5)
            record(f"latency {label} p99", p99, f99, "ms", "< 2x the floor's p99", "raw SDK upload", met=p99 < 2 * f99)
    sc.stop()


def rclone_env(t: Target) -> dict[str, str]:
    """rclone 1.60 reaches Azurite on a custom port only through an account SAS URL (on the
    identity path too: see Target.rclone_flags)."""
    sas = generate_account_sas(DEV_ACCOUNT, DEV_KEY, ResourceTypes(service=True, container=True, object=True),
                               AccountSasPermissions(read=True, write=True, list=True, delete=True, add=True,
                                                     create=True),
                               expiry=datetime.now(timezone.utc) + timedelta(hours=2))
    env = dict(os.environ)
    env.update(RCLONE_CONFIG_AZ_TYPE="azureblob", RCLONE_CONFIG_AZ_SAS_URL=f"{t.url}?{sas}")
    return env


def run_rclone(args: list[str], t: Target) -> float | None:
    if shutil.which("rclone") is None:
        return None
    env = rclone_env(t)
    t0 = time.perf_counter()
    subprocess.run(["rclone", *args, "--transfers", "16", "--checkers", "16", "-q", *t.rclone_flags()], env=env,
                   check=True)
    return time.perf_counter() - t0


async def raw_upload_tree(t: Target, container: str, src: Path, prefix: str, inflight: int = 16) -> float:
    files = sorted(p for p in src.rglob("*") if p.is_file())
    sem = asyncio.Semaphore(inflight)
    async with t.service() as svc:
        cc = svc.get_container_client(container)
        try:
            await cc.create_container()
        except Exception:
            pass
        t0 = time.perf_counter()

        async def one(p: Path) -> None:
            async with sem:
                data = await asyncio.to_thread(p.read_bytes)
                await cc.get_blob_client(f"{prefix}/{p.relative_to(src)}").upload_blob(data, overwrite=True)

        await asyncio.gather(*(one(p) for p in files))
        return time.perf_counter() - t0


async def bench_burst(t: Target, tmp: Path, n: int) -> None:
    work = tmp / "burst"
    (work / ".checkpoints").mkdir(parents=True)
    staging = work / "staging"
    for i in range(n):
        (staging / f"d{i % 20}").mkdir(parents=True, exist_ok=True)
        (staging / f"d{i % 20}" / f"{i}.json").write_bytes(os.urandom(16 * 1024))
    ref = await raw_upload_tree(t, "burstraw", staging, "raw")
    rc = run_rclone(["copy", str(staging), "az:burstrclone"], t)
    sc = SidecarProc(["sync", "--store", f"{t.url}/burst", "--log-level", "debug"], work, t.sidecar_env())
    sc.wait("ready", timeout=60)
    t0 = time.perf_counter()
    os.rename(staging, work / ".checkpoints" / "burst")  # all 1,000 appear at once
    t_last = t0
    for _ in range(n):
        t_last = sc.wait("uploaded")
    drain = t_last - t0
    sc.stop()
    record(f"burst {n} x 16 KiB drain", drain, ref, "s", "<= raw SDK", "raw SDK, 16 in flight", met=drain <= ref)
    if rc is not None:
        record(f"burst {n} x 16 KiB drain", drain, rc, "s", "(informational)", "rclone copy --transfers 16")


def seed_with_points(t: Target, tmp: Path, name: str, n: int, size: int) -> None:
    """The store as a session leaves it: ``n`` files of ``size`` bytes mirrored by the installed
    sidecar (``run -- true`` beside a disk that holds them), whose drain writes the restore point
    a restore reads (docs/RESTORE.md, "Restore points")."""
    seed = tmp / f"{name}-seed"
    for i in range(n):
        d = seed / ".checkpoints" / f"c{i % 50}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i}.json").write_bytes(os.urandom(size))
    out = subprocess.run([*sidecar_cmd(), "run", "--store", f"{t.url}/{name}", "--http-addr", "",
                          "--no-restore", "--", "true"], cwd=seed, env=t.sidecar_env(),
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"seeding run exited {out.returncode}: {out.stderr[-2000:]}")
    if not any(e.get("event") == "restore_point" for e in json_lines(out.stderr)):
        raise RuntimeError(f"seeding run wrote no restore point: {out.stderr[-2000:]}")
    shutil.rmtree(seed)


def bench_restore(t: Target, tmp: Path, n: int, size: int, rounds: int) -> None:
    name = f"restore-{n}x{size // 1024}k"
    seed_with_points(t, tmp, name, n, size)
    ours, theirs = [], []
    env = t.sidecar_env()

    def run_ours(r: int) -> None:
        work = tmp / f"{name}-ours{r}"
        work.mkdir()
        t0 = time.perf_counter()
        subprocess.run([*sidecar_cmd(), "restore", "--store", f"{t.url}/{name}", "--log-level", "warning"],
                       cwd=work, env=env, check=True)
        ours.append(time.perf_counter() - t0)
        assert sum(1 for p in (work / ".checkpoints").rglob("*.json")) == n

    def run_theirs(r: int) -> None:
        rc = run_rclone(["copy", f"az:{name}/.checkpoints", str(tmp / f"{name}-rclone{r}")], t)
        if rc is not None:
            theirs.append(rc)

    # Interleaved, both see the same emulator state; who goes first alternates (the emulator
    # collects garbage from the previous run), and round 0 only warms the emulator's JIT and is
    # not counted. Each run starts as on a fresh disk: nothing is deleted until the figure is done
    # (ext4 scans the inodes deleted in the last 30 s on every create: up to a fifth of a
    # restore's CPU, varying from run to run), and the previous run's writes are flushed first
    # (rclone does not flush; the sidecar's final syncfs would flush them for it).
    floors: dict[str, list[float]] = {"imports": [], "listing": [], "point": [], "both": []}

    def run_floors(r: int) -> None:
        for part, secs in restore_floors(t, name).items():
            floors[part].append(secs)

    for r in range(rounds + 1):
        for run in ((run_ours, run_theirs, run_floors) if r % 2 else (run_floors, run_theirs, run_ours)):
            os.sync()
            run(r)
        if r == 0:
            ours.clear()
            theirs.clear()
            for part in floors.values():
                part.clear()
    for r in range(rounds + 1):
        shutil.rmtree(tmp / f"{name}-ours{r}", ignore_errors=True)
        shutil.rmtree(tmp / f"{name}-rclone{r}", ignore_errors=True)
    print(f"    restore rounds: ours {', '.join(f'{x:.2f}' for x in ours)} s; rclone {', '.join(f'{x:.2f}' for x in theirs)} s")
    mine, ref = statistics.median(ours), (statistics.median(theirs) if theirs else None)
    target = 0.5 if size <= 8 * 1024 else 0.9  # (goals: 0.35x and 0.7x)
    record(f"restore {n} x {size // 1024} KiB (median of {rounds})", mine, ref, "s", f"<= {target}x rclone",
           "rclone copy --transfers 16" + (" (account SAS over the same TLS)" if t.credential == "identity" else ""),
           met=None if ref is None else mine <= target * ref, ours=[round(x, 3) for x in ours],
           rclone=[round(x, 3) for x in theirs])
    # The named stack's own floor for this restore, whatever the sidecar does around it: its
    # packages' imports, then the SDK's listing of the namespace and its GET of the point at once,
    # as the restore sends them (nothing before the imports can send a request)
    med = {part: statistics.median(v) for part, v in floors.items()}
    floor = med["imports"] + med["both"]
    print(f"    floors (medians): imports {med['imports'] * 1e3:.0f} ms, SDK listing {med['listing'] * 1e3:.0f} ms, "
          f"SDK point GET {med['point'] * 1e3:.0f} ms, the two at once {med['both'] * 1e3:.0f} ms")
    record(f"restore {n} x {size // 1024} KiB, the stack's floor", floor, ref, "s", f"<= {target}x rclone", "the same rclone",
           met=None if ref is None else floor <= target * ref, **{k: round(v, 3) for k, v in med.items()})


#: The named packages the restore path imports before its first request (bench: their floor).
NAMED_IMPORTS = "import anyio, aiohttp, pydantic_settings, azure.storage.blob.aio"


def restore_floors(t: Target, container: str) -> dict[str, float]:
    """Seconds: a fresh interpreter importing the named packages (and azure.identity on the
    identity path; the interpreter's own start included, as the sidecar pays it too); the raw SDK
    listing the container with metadata (as the restore lists a namespace); its GET of the largest
    restore point, read to the end (the SDK's default chunks); and the two at once."""
    stmt = NAMED_IMPORTS + (", azure.identity.aio" if t.credential == "identity" else "")
    t0 = time.perf_counter()
    subprocess.run([SIDECAR_PY, "-c", stmt], check=True, env=plain_env())
    imports = time.perf_counter() - t0

    async def sdk() -> dict[str, float]:
        async with t.service() as svc:
            cc = svc.get_container_client(container)
            point = max([b async for b in cc.list_blobs(name_starts_with=".sidecar/points/")], key=lambda b: b.size)

            async def listing() -> float:
                t0 = time.perf_counter()
                async for _ in cc.list_blobs(include=["metadata"]):
                    pass
                return time.perf_counter() - t0

            async def get() -> float:
                t0 = time.perf_counter()
                stream = await cc.download_blob(point.name)
                async for _ in stream.chunks():
                    pass
                return time.perf_counter() - t0

            alone = {"listing": await listing(), "point": await get()}
            t0 = time.perf_counter()
            await asyncio.gather(listing(), get())
            return {**alone, "both": time.perf_counter() - t0}

    return {"imports": imports, **asyncio.run(sdk())}


def proc_stats(pid: int) -> tuple[float, int]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return cpu, rss * 1024


async def bench_footprint(t: Target, tmp: Path, n: int, seconds: float) -> None:
    work = tmp / "idle"
    for i in range(n):
        p = work / ".checkpoints" / f"u{i % 10}" / f"c{i % 500}" / f"{i}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"{}")
    sc = SidecarProc(["sync", "--store", f"{t.url}/idle"], work, t.sidecar_env())
    sc.wait("ready", timeout=300)
    while sc.proc.poll() is None:  # until the initial reconcile's uploads are done
        status = subprocess.run([*sidecar_cmd(), "status", "--store", f"{t.url}/idle"], cwd=work,
                                env=t.sidecar_env(), capture_output=True)
        if status.returncode == 0:
            break
        time.sleep(1)
    cpu0, _ = proc_stats(sc.proc.pid)
    t0 = time.monotonic()
    time.sleep(seconds)
    cpu1, rss = proc_stats(sc.proc.pid)
    sc.stop()
    cpu = 100 * (cpu1 - cpu0) / (time.monotonic() - t0)
    record(f"idle RSS, {n} files", rss / 2**20, None, "MiB", "< 80 MiB", "", met=rss < 80 * 2**20)
    record(f"idle CPU over {seconds:.0f} s", cpu, None, "%", "< 0.5 % of a core", "", met=cpu < 0.5)


def seed_scaling_tree(work: Path, store: Path, n: int) -> None:
    """``n`` small files under ``work/.checkpoints`` in 1,000 directories, all of them stored in
    the directory store ``store`` (setup only, not measured: written without fsync). The drain
    must finish the seed, or measured writes would queue behind what is left of it."""
    for i in range(n):
        p = work / ".checkpoints" / f"u{i % 10}" / f"c{i % 1000}" / f"{i}.json"
        if i < 1000:
            p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"{}")
    seed = ("import os, sys; os.fsync = lambda fd: None; from sidecar.cli import main; "
            "sys.exit(main(['run', '--store', sys.argv[1], '--http-addr', '', '--drain-timeout', '3600', '--', 'true']))")
    subprocess.run([SIDECAR_PY, "-c", seed, str(store)], cwd=work, env=plain_env(), check=True,
                   stderr=subprocess.DEVNULL)


def bench_scaling(tmp: Path, sizes: list[int], writes: int) -> None:
    p50s = []
    for n in sizes:
        work, store = tmp / f"scale{n}", tmp / f"scale{n}-store"
        seed_scaling_tree(work, store, n)
        sc = SidecarProc(["sync", "--store", str(store), "--log-level", "debug"], work, plain_env())
        lat = []
        try:
            sc.wait("ready", timeout=600)
            for i in range(writes):
                key = f"u0/c0/new-{i}.json"
                t0 = time.perf_counter()
                write_atomic(work / ".checkpoints" / key, os.urandom(4096))
                lat.append(sc.wait("uploaded", f".checkpoints/{key}") - t0)
        finally:
            sc.stop()
        p50s.append(pct(lat, 50) * 1e3)
        shutil.rmtree(work)
        shutil.rmtree(store)
    record(f"write -> durable p50, {sizes[1]} vs {sizes[0]} files", p50s[1], p50s[0], "ms",
           "ratio ~1 (no growth with the tree)", f"same with {sizes[0]} files (directory store)")


def wait_ready_precisely(host, timeout: float) -> float:
    """Seconds from the host's launch until ``/readiness`` answers 200, to a few ms.

    The tests' ``wait_ready`` polls with httpx every 50 ms, which puts the figure on a 50 ms grid;
    polling httpx every few ms instead costs enough CPU to slow the host itself. A bare connect
    to a closed port costs microseconds, so this tries one every 2 ms and sends its own request.
    """
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if host.proc.poll() is not None:
            raise RuntimeError(f"agent host exited with {host.proc.returncode}{host.log_tail()}")
        try:
            with socket.create_connection(("127.0.0.1", host.port), timeout=2) as s:
                s.sendall(b"GET /readiness HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                if s.recv(16).startswith(b"HTTP/1.1 200"):
                    return time.monotonic() - host.started_at
        except OSError:
            pass
        time.sleep(0.002)
    raise RuntimeError(f"agent host not ready within {timeout} s{host.log_tail()}")


def bench_coldstart(t: Target, tmp: Path, rounds: int) -> None:
    from agenthost import AgentHost, ensure_venv

    python = ensure_venv("issue")
    from sidecar.store import make_store
    from sidecar.store.base import ObjectMeta

    async def seed() -> None:
        store = make_store(f"{t.url}/cold", env=t.key_env())
        await store.open()
        for i in range(20):
            data = os.urandom(100 * 1024)
            await store.put(f".checkpoints/resp_{i}/{i}.json", data, ObjectMeta.of(data, time.time_ns(), 0o600))
        await store.aclose()

    asyncio.run(seed())
    wrapper = [*sidecar_cmd(), "run", "--store", f"{t.url}/cold", "--http-addr", "", "--"]
    env = t.overlay_env()
    bare, wrapped, spawned = [], [], []
    # Round 0 warms what a long-lived service would have warm and is not counted: the page cache
    # for both virtual environments, and the emulator's JIT for its GET and LIST paths (the seed
    # above only exercised PUT; a fresh Azurite's first restore takes about 100 ms longer).
    for r in range(rounds + 1):
        for label, wrap, out in (("bare", None, bare), ("wrapped", wrapper, wrapped)):
            work = tmp / f"cold-{label}-{r}"
            work.mkdir()
            host = AgentHost(work, python, wrapper=wrap, env=env)
            launched = time.time()
            host.start()
            out.append(wait_ready_precisely(host, 60))
            host.stop()
            if wrap:  # when the sidecar started the host, from its own log
                started = next(e["ts"] for e in json_lines(host.log)
                               if e.get("event") == "child_started")
                spawned.append(datetime.fromisoformat(started.replace("Z", "+00:00")).timestamp() - launched)
                assert len(list((work / ".checkpoints").rglob("*.json"))) == 20
        if r == 0:
            for figures in (bare, wrapped, spawned):
                figures.clear()
    b, w = statistics.median(bare), statistics.median(wrapped)
    print(f"    cold start rounds (ms): bare {', '.join(f'{x * 1e3:.0f}' for x in bare)}; "
          f"wrapped {', '.join(f'{x * 1e3:.0f}' for x in wrapped)}; the sidecar started the host after "
          f"{', '.join(f'{x * 1e3:.0f}' for x in spawned)}")
    budget = 300 if t.credential == "identity" else 200
    record("cold start to /readiness (median)", w * 1e3, b * 1e3, "ms", f"<= {budget} ms added", "bare host",
           met=(w - b) * 1e3 <= budget, added_ms=round((w - b) * 1e3, 1),
           spawned_median_ms=round(statistics.median(spawned) * 1e3, 1),
           bare=[round(x * 1e3, 1) for x in bare], wrapped=[round(x * 1e3, 1) for x in wrapped])


def bench_points(quick: bool) -> None:
    """bench/points_cost.py in this process (its own Azurite and counting proxy, the checkout's
    sidecar: the point writer is driven directly, on a simulated clock)."""
    sys.path.insert(0, str(REPO / "bench"))
    import points_cost

    r = points_cost.main(["--namespace-mib", "4", "--hours", "0.1"] if quick else [])
    mib = 1 << 20
    record("restore points, MiB stored per hour", r["with_one_full_a_day_bytes_per_hour"] / mib,
           r["host_changed_bytes_per_hour"] / mib, "MiB", "<= 3x changed + a full a day", "host changed",
           met=r["with_one_full_a_day_bytes_per_hour"] <= r["target_bytes_per_hour"],
           requests_per_hour=r["point_requests_per_hour"], incremental_bytes_per_hour=r["point_bytes_per_hour"],
           full_point_bytes=r["first_full"]["bytes"])


def main() -> int:
    ap = argparse.ArgumentParser(description="checkpoint-sidecar benchmarks")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: keeps the harness working, figures meaningless")
    ap.add_argument("--only", default="latency,burst,restore,footprint,scaling,coldstart,points")
    ap.add_argument("--credential", choices=("key", "identity", "both"), default="key",
                    help="the credential path of the Azure figures: account key (connection string, http) or "
                         "managed identity (emulated IDENTITY_ENDPOINT, bearer tokens, https); see bench/credentials.py; "
                         "both: every Azure figure on each, one after the other, in one run")
    args = ap.parse_args()
    only = set(args.only.split(","))
    q = args.quick
    OUT.mkdir(parents=True, exist_ok=True)
    global SIDECAR_PY
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"credential path: {args.credential}")
    print(f"  {'figure':42} {'project':>10} {'reference':>10} unit  {'ratio':>7}")
    with tempfile.TemporaryDirectory(prefix="sidecar-bench-", ignore_cleanup_errors=True) as d:
        tmp = Path(d)
        SIDECAR_PY = install_sidecar(tmp / "sidecar-venv")
        # Each figure gets a fresh emulator: Azurite keeps every blob's metadata in one in-memory
        # collection and slows down as it fills (10,000 blobs left by the footprint run added
        # about 150 ms to a cold start), which a real account does not.
        credentials = ("key", "identity") if args.credential == "both" else (args.credential,)
        current = [credentials[0]]

        def fresh(name: str) -> Target:
            return Target(current[0], tmp / f"azurite-{name}-{current[0]}", tmp / "pki")

        def figure(name: str, run) -> None:
            """One figure; a failure is printed and recorded, and the other figures still run."""
            if name not in only:
                return
            try:
                run()
            except Exception as e:  # noqa: BLE001
                print(f"  {name}: FAILED: {type(e).__name__}: {e}", flush=True)
                RESULTS.append({"figure": name, "failed": f"{type(e).__name__}: {e}"})

        def azure(name: str, bench, *params) -> None:
            def run() -> None:
                with fresh(name) as t:
                    out = bench(t, tmp, *params)
                    if asyncio.iscoroutine(out):
                        asyncio.run(out)
            figure(name, run)

        for credential in credentials:
            current[0] = CREDENTIAL[0] = credential
            if len(credentials) > 1:
                print(f"  -- credential path: {credential}")
            azure("latency", bench_latency, 20 if q else 300)
            azure("burst", bench_burst, 100 if q else 1000)
            azure("restore", bench_restore, 100 if q else 1000, 10 * 1024 if q else 100 * 1024, 1 if q else 9)
            azure("restore", bench_restore, 200 if q else 2000, 4 * 1024, 1 if q else 9)
            azure("footprint", bench_footprint, 500 if q else 10_000, 3 if q else 60)
        if "key" in credentials:
            figure("scaling", lambda: bench_scaling(tmp, [200, 2000] if q else [1000, 100_000], 10 if q else 100))
        elif "scaling" in only:
            print("  scaling: the directory store has no credential; measured with --credential key only")
        for credential in credentials:
            current[0] = CREDENTIAL[0] = credential
            azure("coldstart", bench_coldstart, 1 if q else 11)
        figure("points", lambda: bench_points(q))
    name = ("results" + ("" if args.credential == "key" else f"-{args.credential}") + ("-quick" if q else "")
            + ("" if args.only == ap.get_default("only") else "-" + args.only.replace(",", "-")))
    out = OUT / f"{name}.json"
    out.write_text(json.dumps({"machine": platform.platform(), "cores": os.cpu_count(), "quick": q,
                               "credential": args.credential, "only": sorted(only), "results": RESULTS}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
