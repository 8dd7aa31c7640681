"""What each command imports before it does its work: ``python -X importtime`` of the real
commands against a fresh Azurite, on both credential paths (bench/credentials.py).

    .venv/bin/python bench/startpath.py                  # key and identity, every command
    .venv/bin/python bench/startpath.py --credential key --top 15

For each of ``restore``, ``run -- true``, ``status`` and ``--help`` (20 files in the store, an empty
working directory) it runs the command once to warm the page cache and bytecode, then ``--rounds``
times under ``-X importtime`` (the checkout first on PYTHONPATH, bytecode written), and prints the
command's wall time and the modules whose cumulative import time is largest (median over the
rounds), the top-level ones marked. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from credentials import Target  # noqa: E402  (bench/credentials.py)

_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")
#: Modules always shown when imported, whatever their rank: what the task keeps off the path.
WATCHED = ("azure.identity", "prometheus_client", "watchfiles", "sidecar.watcher", "sidecar.uploader",
           "azure.storage.blob.aio", "azure.storage.blob", "pydantic_settings", "sidecar.config", "aiohttp",
           "msal", "cryptography", "uvloop")


def parse(stderr: str) -> dict[str, tuple[int, int]]:
    """module -> (cumulative us, nesting depth) from ``-X importtime`` output."""
    out = {}
    for line in stderr.splitlines():
        m = _LINE.match(line)
        if m:
            out[m[4]] = (int(m[2]), len(m[3]) // 2)
    return out


def measure(args: list[str], cwd: Path, env: dict[str, str], rounds: int,
            warm: bool = True) -> tuple[float, dict[str, int], set[str]]:
    """Median wall ms, median cumulative import us per module, and the top-level modules."""
    cmd = [sys.executable, "-X", "importtime", "-m", "sidecar", *args]
    if warm:
        subprocess.run(cmd, cwd=cwd, env=env, capture_output=True)
    walls, cums, top = [], [], set()
    for _ in range(rounds):
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        walls.append((time.perf_counter() - t0) * 1e3)
        if r.returncode not in (0, 1):  # status: 1 when not in sync
            raise SystemExit(f"{args}: exit {r.returncode}: {r.stderr[-2000:]}")
        parsed = parse(r.stderr)
        cums.append({m: c for m, (c, _) in parsed.items()})
        top |= {m for m, (_, d) in parsed.items() if d == 0}
    names = set().union(*cums)
    return statistics.median(walls), {m: int(statistics.median(c.get(m, 0) for c in cums)) for m in names}, top


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--credential", choices=("key", "identity", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--phases", action="store_true",
                    help="only the phases of `run --` restoring 20 files from a restore point (no -X importtime)")
    ap.add_argument("--tree", default=str(REPO), help="with --phases: the checkout measured (its sidecar package)")
    a = ap.parse_args()
    if a.phases:
        return phases(a.credential, a.rounds, a.tree)
    with tempfile.TemporaryDirectory(prefix="sidecar-startpath-") as d:
        tmp = Path(d)
        for credential in (("key", "identity") if a.credential == "both" else (a.credential,)):
            with Target(credential, tmp / f"azurite-{credential}", tmp / "pki") as t:
                asyncio.run(seed(t))
                env = {**t.sidecar_env(), "PYTHONPATH": str(REPO), "SIDECAR_STORE": f"{t.url}/start",
                       "SIDECAR_LOG_LEVEL": "warning"}
                env.pop("PYTHONDONTWRITEBYTECODE", None)
                print(f"## credential path: {credential}")
                for label, args in (("restore", ["restore"]), ("run -- true", ["run", "--", "true"]),
                                    ("status", ["status"]), ("--help", ["--help"])):
                    work = tmp / f"work-{credential}-{label.split()[0].strip('-')}"
                    work.mkdir()
                    if label == "restore":  # a fresh directory each round: every round restores
                        wall, cum, top = measure_restore(work, env, a.rounds)
                    else:
                        wall, cum, top = measure(args, work, env, a.rounds)
                    shown = sorted(cum, key=lambda m: -cum[m])
                    picked = [m for m in shown if m in top][: a.top]
                    picked += [m for m in WATCHED if m in cum and m not in picked]
                    print(f"\n{label}: {wall:.0f} ms wall (median of {a.rounds}, -X importtime on)")
                    for m in sorted(picked, key=lambda m: -cum[m]):
                        print(f"  {cum[m] / 1e3:7.1f} ms  {m}{'' if m in top else '  (nested)'}")
                print()
    return 0


def measure_restore(work: Path, env: dict[str, str], rounds: int) -> tuple[float, dict[str, int], set[str]]:
    results = []
    for r in range(rounds + 1):
        d = work / str(r)
        d.mkdir()
        results.append(measure(["restore"], d, env, 1, warm=False))
        if not any((d / ".checkpoints").rglob("*.json")):
            raise SystemExit("restore restored nothing")
    results = results[1:]  # the first warms
    names = set().union(*(c for _, c, _ in results))
    return (statistics.median(w for w, _, _ in results),
            {m: int(statistics.median(c.get(m, 0) for _, c, _ in results)) for m in names},
            set().union(*(t for _, _, t in results)))


#: The events that end each phase of ``run --`` (its JSON log, debug level): the restore begins
#: once the imports and the configuration are done; the namespace's store answered; the roots
#: decided; then the child's own clock (it prints it) says when it started.
PHASES = (("imports done", "phase"), ("store answered", "store"), ("roots decided", "restore_decision"))


def phases(credential: str, rounds: int, tree: str) -> int:
    """launch -> imports done -> store answered -> roots decided -> child started, for ``run --``
    restoring 20 files of 100 KiB from a restore point into an empty directory; medians (ms)."""
    import json
    from datetime import datetime, timezone

    def stamp(ts: str) -> float:
        return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()

    with tempfile.TemporaryDirectory(prefix="sidecar-phases-") as d:
        tmp = Path(d)
        for cred in (("key", "identity") if credential == "both" else (credential,)):
            with Target(cred, tmp / f"azurite-{cred}", tmp / "pki") as t:
                env = {**t.sidecar_env(), "PYTHONPATH": tree, "SIDECAR_STORE": f"{t.url}/start",
                       "SIDECAR_LOG_LEVEL": "debug", "SIDECAR_HTTP_ADDR": ""}
                env.pop("PYTHONDONTWRITEBYTECODE", None)
                seed_dir = tmp / f"seed-{cred}" / ".checkpoints"
                for i in range(20):
                    (seed_dir / f"resp_{i}").mkdir(parents=True)
                    (seed_dir / f"resp_{i}" / f"{i}.json").write_bytes(os.urandom(100 * 1024))
                subprocess.run([sys.executable, "-m", "sidecar", "run", "--no-restore", "--", "true"],
                               cwd=seed_dir.parent, env=env, check=True, capture_output=True)
                rows: list[list[float]] = []
                for r in range(rounds + 1):
                    work = tmp / f"phases-{cred}-{r}"
                    work.mkdir()
                    t0 = time.time()
                    out = subprocess.run([sys.executable, "-m", "sidecar", "run", "--", "sh", "-c", "date +%s.%N >&2"],
                                         cwd=work, env=env, capture_output=True, text=True, check=True)
                    events = [json.loads(x) for x in out.stderr.splitlines() if x.startswith("{")]
                    child = float(next(x for x in out.stderr.splitlines() if x[:1].isdigit()))
                    ends = [stamp(next(e["ts"] for e in events if e["event"] == name)) for _, name in PHASES]
                    if r:  # the first warms the page cache
                        rows.append([(x - t0) * 1e3 for x in [*ends, child]])
                med = [statistics.median(c) for c in zip(*rows, strict=True)]
                print(f"## {cred}: run -- restoring 20 x 100 KiB from a point, median of {rounds} (ms after launch)")
                labels = [label for label, _ in PHASES] + ["child started"]
                for i, label in enumerate(labels):
                    step = med[i] - (med[i - 1] if i else 0.0)
                    print(f"  {label:15} {med[i]:7.0f}  (+{step:.0f})")
                print(f"  imports done -> child started: {med[-1] - med[0]:.0f} ms")
    return 0


async def seed(t: Target) -> None:
    """20 files of 100 KiB, as the cold-start figure restores."""
    from sidecar.store import make_store
    from sidecar.store.base import ObjectMeta

    store = make_store(f"{t.url}/start", env=t.key_env())
    await store.open()
    for i in range(20):
        data = os.urandom(100 * 1024)
        await store.put(f".checkpoints/resp_{i}/{i}.json", data, ObjectMeta.of(data, time.time_ns(), 0o600))
    await store.aclose()


if __name__ == "__main__":
    raise SystemExit(main())
