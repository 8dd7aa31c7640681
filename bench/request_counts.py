"""Store requests per sparse checkpoint and per idle hour of a running ``sync``, against Azurite.

    .venv/bin/python bench/request_counts.py [--tree DIR ...] [--checkpoints 10] [--gap 3] [--idle 30]

Starts its own Azurite (tests/azurite.py) behind the counting proxy of tests/proxy.py, then, for
each source tree given (default: this checkout; a tree is a directory holding ``sidecar/``, e.g.
``git archive e940c49 sidecar | tar -x -C /tmp/before``), runs ``python -m sidecar sync`` from it
on a fresh container and counts every request the proxy forwards, by method and by what it is
for (the owner marker, the sidecar's other objects, the mirrored files, container and listing
requests):

* **checkpoints**: once the sidecar is ready and quiet, writes ``--checkpoints`` new 4 KiB files
  ``--gap`` seconds apart (each more than a fence window after the last: every write needs a
  proof), waits until the last is stored, and counts the requests in between;
* **idle**: then counts ``--idle`` seconds without writes, with the heartbeat every
  ``--heartbeat`` seconds where the tree has one. An idle *hour* is reported by arithmetic:
  the measured marker writes per heartbeat interval times 3600 / the default interval (900 s),
  plus one full listing per hour (``SIDECAR_FULL_RECONCILE_INTERVAL``, 3600 s: one LIST page per
  5,000 blobs); measuring a real hour would say the same an hour later.

Write operations are PUT, POST and DELETE requests (what Azure bills as writes, beside LIST).
Prints a table and writes bench/out/requests.json. Counts, not timings: they do not depend on
the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from tests.azurite import Azurite, connection_string, unique_container  # noqa: E402
from tests.proxy import Proxy, Record  # noqa: E402

OUT = REPO / "bench" / "out" / "requests.json"
#: The heartbeat's default interval (SIDECAR_HEARTBEAT_INTERVAL), for the per-hour arithmetic.
DEFAULT_HEARTBEAT = 900.0
MARKER = ".sidecar/owner"
WRITES = ("PUT", "POST", "DELETE")


def kind(r: Record) -> str:
    """What a request is for: ``marker``, ``sidecar`` (bundles), ``file``, or ``container``
    (container requests and listings, which name no blob)."""
    if r.query and "comp=list" in r.query:
        return "list"
    if not r.blob:
        return "container"
    if r.blob == MARKER:
        return "marker"
    if r.blob.startswith(".sidecar/"):
        return "sidecar"
    return "file"


def tally(records: list[Record]) -> dict[str, int]:
    counts = Counter(f"{r.method} {kind(r)}" for r in records if r.action == "forwarded")
    return dict(sorted(counts.items()))


def writes(counts: dict[str, int]) -> int:
    return sum(n for k, n in counts.items() if k.split()[0] in WRITES)


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def quiet(proxy: Proxy, seconds: float, timeout: float = 60) -> None:
    """Wait until no request has arrived for ``seconds``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        last = proxy.records[-1].t if proxy.records else 0.0
        if time.monotonic() - last >= seconds:
            return
        time.sleep(0.1)
    raise TimeoutError("the sidecar never went quiet")


def timeline(records: list[Record], since: float) -> list[str]:
    return [f"{r.t - since:8.3f} {r.method} {r.blob or r.query} {r.status}" for r in records]


def run_sidecar(tree: Path, azurite: Azurite, proxy: Proxy, work: Path, heartbeat: float | None):
    """A started ``sync`` of ``tree`` on a fresh container, ready and quiet: (process, root)."""
    container = unique_container("requests")
    store = proxy.via(f"{azurite.url}/{container}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIDECAR_", "AZURE_"))}
    env.update(PYTHONPATH=str(tree), AZURE_STORAGE_CONNECTION_STRING=connection_string(proxy.via(azurite.url)),
               SIDECAR_HTTP_ADDR="", SIDECAR_LOG_FORMAT="json", SIDECAR_SESSION_NAMESPACE="off")
    if heartbeat is not None:
        env["SIDECAR_HEARTBEAT_INTERVAL"] = str(heartbeat)
    roots = work / ".checkpoints"
    roots.mkdir(parents=True)
    log = work / "sidecar.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "sidecar", "sync", "--store", store, "--roots", str(roots)],
                                cwd=work, env=env, stdout=logf, stderr=subprocess.STDOUT)
    wait(lambda: b'"ready"' in log.read_bytes() or proc.poll() is not None, 60, "ready")
    if proc.poll() is not None:
        raise RuntimeError(f"the sidecar of {tree} exited {proc.returncode}:\n{log.read_text()}")
    quiet(proxy, 2.0)
    return proc, roots


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(30)


def measure(tree: Path, azurite: Azurite, proxy: Proxy, args: argparse.Namespace, work: Path) -> dict:
    """The checkpoints and an idle spell with the tree's defaults, then (a tree with a heartbeat)
    an idle spell of a second sidecar whose heartbeat is ``args.heartbeat``."""
    has_heartbeat = "heartbeat_interval" in (tree / "sidecar" / "config.py").read_text()
    proc, roots = run_sidecar(tree, azurite, proxy, work / "a", None)
    try:
        start = len(proxy.records)
        t_start = time.monotonic()
        for i in range(args.checkpoints):
            if i:
                time.sleep(args.gap)
            write_atomic(roots / "thread" / f"checkpoint-{i:03}.json", os.urandom(2048).hex().encode())
        last = f".checkpoints/thread/checkpoint-{args.checkpoints - 1:03}.json"
        wait(lambda: any(r.blob == last and r.method == "PUT" and r.status == 201
                         for r in proxy.records[start:]),
             60, "the last checkpoint stored")
        quiet(proxy, 1.0)
        during = proxy.records[start:]
        checkpoints = tally(during)
        start, t0 = len(proxy.records), time.monotonic()
        time.sleep(args.idle)
        idle_seconds = time.monotonic() - t0
        idle = tally(proxy.records[start:])
    finally:
        stop(proc)
    heartbeat_idle: dict[str, int] = {}
    per_interval = 0.0
    if has_heartbeat:
        proc, _ = run_sidecar(tree, azurite, proxy, work / "b", args.heartbeat)
        try:
            start, t0 = len(proxy.records), time.monotonic()
            time.sleep(args.idle)
            heartbeat_seconds = time.monotonic() - t0
            heartbeat_idle = tally(proxy.records[start:])
        finally:
            stop(proc)
        per_interval = writes(heartbeat_idle) / (heartbeat_seconds / args.heartbeat)
    return {
        "tree": str(tree),
        "checkpoints": args.checkpoints,
        "gap_seconds": args.gap,
        "checkpoint_requests": checkpoints,
        "write_ops_per_checkpoint": round(writes(checkpoints) / args.checkpoints, 3),
        "requests_per_checkpoint": round(sum(checkpoints.values()) / args.checkpoints, 3),
        "timeline": timeline(during, t_start),
        "idle_seconds": round(idle_seconds, 1),
        "idle_requests": idle,
        "heartbeat_interval_measured": args.heartbeat if has_heartbeat else None,
        "idle_requests_with_that_heartbeat": heartbeat_idle,
        "idle_hour_write_ops": round(per_interval * 3600 / DEFAULT_HEARTBEAT, 2) if has_heartbeat else 0,
        "idle_hour_note": ("write operations per heartbeat interval, measured with a short interval, x 3600 / 900 s "
                           "(the default interval); besides, one full listing per hour "
                           "(SIDECAR_FULL_RECONCILE_INTERVAL): 1 LIST page per 5,000 blobs"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", type=Path, help="a source tree holding sidecar/ (repeatable)")
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--gap", type=float, default=3.0, help="seconds between checkpoints")
    ap.add_argument("--idle", type=float, default=30.0, help="seconds of idling measured")
    ap.add_argument("--heartbeat", type=float, default=5.0, help="the heartbeat interval while measuring idling")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    trees = [t.resolve() for t in (args.tree or [REPO])]

    results = []
    with tempfile.TemporaryDirectory(prefix="requests-bench-") as location:
        with Azurite(os.path.join(location, "azurite")) as server, Proxy.before(server.url) as proxy:
            for n, tree in enumerate(trees):
                results.append(measure(tree, server, proxy, args, Path(location) / f"work{n}"))
    print(f"{'tree':40}{'writes/ckpt':>12}{'reqs/ckpt':>10}{'idle writes/h':>14}  requests over the checkpoints")
    for r in results:
        print(f"{r['tree'][-40:]:40}{r['write_ops_per_checkpoint']:>12}{r['requests_per_checkpoint']:>10}"
              f"{r['idle_hour_write_ops']:>14}  {r['checkpoint_requests']}")
        print(f"{'':40}{'':36}  idle {r['idle_seconds']} s: {r['idle_requests']}; with a heartbeat every "
              f"{r['heartbeat_interval_measured']} s: {r['idle_requests_with_that_heartbeat']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"results": results, "python": platform.python_version(),
                                    "unix_time": int(time.time())}, indent=2) + "\n")
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
