"""Peak RSS of the sidecar while it uploads and restores, next to the manifests' memory limit.

    .venv/bin/python bench/memory.py [--case large,snapshot,many] [--store directory|azure|both]
                                     [--size-mib 1024] [--snapshot-mib 200] [--many 40]

Cases:

* ``large``: one file of ``--size-mib`` (streamed in chunks both ways);
* ``snapshot``: two files of ``--snapshot-mib`` in one snapshot commit (``SIDECAR_COMMIT=snapshot``:
  one bundle, then the per-file objects), then restored; and a restore that lays a bundle of
  the same two files (a commit cut short) over the per-file objects;
* ``many``: ``--many`` files just under the streaming threshold (8 MiB - 4 KiB each), uploaded
  at the default concurrency and restored.

Each measurement is one real ``checkpoint-sidecar`` process (``run -- true`` to mirror,
``restore`` into an empty directory); its peak RSS is ``ru_maxrss`` from ``wait4``. Azure runs
against a private Azurite on 127.0.0.1. The limit printed is the sidecar container's
``limits.memory`` in deploy/kubernetes/base/deployment.yaml (the formula behind it:
docs/BENCHMARKS.md#memory).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support import sidecar_env  # noqa: E402
from tests.azurite import Azurite, connection_string  # noqa: E402
from tests.faults.test_large_files import run_measured, sha  # noqa: E402
from tests.faults.test_snapshot_memory import put_bundle, v2_bundle  # noqa: E402

MANIFEST = ROOT / "deploy" / "kubernetes" / "base" / "deployment.yaml"


def manifest_limit_mib() -> int:
    """The sidecar container's memory limit in the base manifest, in MiB."""
    text = MANIFEST.read_text()
    sidecar = text[text.index("- name: checkpoint-sidecar"):]
    m = re.search(r"limits:\s*\n(?:\s*#.*\n)*\s*memory:\s*(\d+)(Mi|Gi)", sidecar)
    assert m, "no memory limit for the sidecar container"
    return int(m.group(1)) * (1024 if m.group(2) == "Gi" else 1)


def write_random(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    block = os.urandom(min(size, 8 << 20))
    with open(path, "wb") as f:
        left = size
        while left:
            f.write(block[:left])
            left -= min(left, len(block))


def mirror_and_restore(env: dict[str, str], tmp: Path, files: dict[str, int]) -> tuple[float, float]:
    src = tmp / "src"
    for name, size in files.items():
        write_random(src / ".checkpoints" / name, size)
    code, up, err = run_measured(["run", "--", "true"], src, env, timeout=1800)
    assert code == 0 and f'"uploaded": {len(files)}' in err, err[-3000:]
    fresh = tmp / "fresh"
    fresh.mkdir()
    code, down, err = run_measured(["restore"], fresh, env, timeout=1800)
    assert code == 0, err[-2000:]
    for name in files:
        assert sha(fresh / ".checkpoints" / name) == sha(src / ".checkpoints" / name), name
    shutil.rmtree(fresh)
    return up, down


def lay_bundle(env: dict[str, str], store_url: str, tmp: Path, files: dict[str, int]) -> float:
    """Peak RSS of a restore that lays a cut-short commit's bundle of ``files`` over the objects."""
    newer = tmp / "newer"
    for name, size in files.items():
        write_random(newer / name, size)
    put_bundle(store_url, v2_bundle({f".checkpoints/{name}": newer / name for name in files}))
    laid = tmp / "laid"
    laid.mkdir()
    code, rss, err = run_measured(["restore"], laid, env, timeout=1800)
    assert code == 0 and "restore_bundle" in err, err[-2000:]
    for name in files:
        assert sha(laid / ".checkpoints" / name) == sha(newer / name), name
    return rss


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="large", help="comma-separated: large, snapshot, many")
    ap.add_argument("--store", default="both", choices=("directory", "azure", "both"))
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--snapshot-mib", type=int, default=200)
    ap.add_argument("--many", type=int, default=40)
    a = ap.parse_args()
    cases = [c.strip() for c in a.case.split(",") if c.strip()]
    limit = manifest_limit_mib()
    print(f"manifests' sidecar memory limit: {limit} MiB ({MANIFEST.relative_to(ROOT)})")
    for kind in (("directory", "azure") if a.store == "both" else (a.store,)):
        for case in cases:
            tmp = Path(tempfile.mkdtemp(prefix=f"mem-{kind}-{case}-"))
            az = None
            old_conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
            try:
                if kind == "azure":
                    az = Azurite(str(tmp / "azurite")).start()
                    store_url = f"{az.url}/memory"
                    os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(az.url)  # for put_bundle
                    env = sidecar_env(SIDECAR_STORE=store_url, AZURE_STORAGE_CONNECTION_STRING=connection_string(az.url))
                else:
                    store_url = str(tmp / "store")
                    env = sidecar_env(SIDECAR_STORE=store_url)
                env["SIDECAR_DRAIN_TIMEOUT"] = "1800"  # run exits with its child's code: flush it all first
                if case == "large":
                    size = a.size_mib << 20
                    env["SIDECAR_MAX_FILE_SIZE"] = str(2 * size)  # the default (256 MiB) would skip the file
                    up, down = mirror_and_restore(env, tmp, {"big.bin": size})
                    what = f"1 x {a.size_mib} MiB"
                    extra = ""
                elif case == "snapshot":
                    size = a.snapshot_mib << 20
                    env["SIDECAR_MAX_FILE_SIZE"] = str(2 * size)
                    env["SIDECAR_COMMIT"] = "snapshot"
                    files = {"a.bin": size, "b.bin": size}
                    up, down = mirror_and_restore(env, tmp, files)
                    laid = lay_bundle(env, store_url, tmp, files)
                    what = f"2 x {a.snapshot_mib} MiB, one snapshot commit"
                    extra = f", bundle restore {laid:.0f} MiB"
                elif case == "many":
                    size = (8 << 20) - 4096
                    up, down = mirror_and_restore(env, tmp, {f"f{i:03d}.bin": size for i in range(a.many)})
                    what = f"{a.many} x 8 MiB - 4 KiB"
                    extra = ""
                else:
                    raise SystemExit(f"unknown case {case!r}")
                print(f"{kind:9}  {what:34}  peak RSS: upload {up:.0f} MiB, restore {down:.0f} MiB{extra}"
                      f"   (limit {limit} MiB)", flush=True)
            finally:
                if az is not None:
                    az.stop()
                if old_conn is None:
                    os.environ.pop("AZURE_STORAGE_CONNECTION_STRING", None)
                else:
                    os.environ["AZURE_STORAGE_CONNECTION_STRING"] = old_conn
                shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
