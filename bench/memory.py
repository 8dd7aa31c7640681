"""Peak RSS of the sidecar while it uploads and restores one large file, next to the file's size.

    .venv/bin/python bench/memory.py [--size-mib 1024] [--store directory|azure|both]

Each measurement is one real ``checkpoint-sidecar`` process (``run -- true`` to mirror the file,
``restore`` into an empty directory); its peak RSS is ``ru_maxrss`` from ``wait4``. Azure runs
against a private Azurite on 127.0.0.1. Target: under 100 MiB whatever the file size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent.parent / "tests")]

from support import sidecar_env  # noqa: E402
from tests.azurite import Azurite, connection_string  # noqa: E402
from tests.faults.test_large_files import run_measured, sha  # noqa: E402


def measure(store_env: dict[str, str], tmp: Path, size: int) -> tuple[float, float]:
    src = tmp / "src" / ".checkpoints"
    src.mkdir(parents=True)
    with open(src / "big.bin", "wb") as f:
        block = os.urandom(8 << 20)
        for _ in range(size // len(block)):
            f.write(block)
    code, up, err = run_measured(["run", "--", "true"], tmp / "src", store_env, timeout=1800)
    assert code == 0 and '"uploaded": 1' in err, err[-3000:]
    fresh = tmp / "fresh"
    fresh.mkdir()
    code, down, err = run_measured(["restore"], fresh, store_env, timeout=1800)
    assert code == 0, err[-2000:]
    assert sha(fresh / ".checkpoints" / "big.bin") == sha(src / "big.bin")
    return up, down


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--store", default="both", choices=("directory", "azure", "both"))
    a = ap.parse_args()
    size = a.size_mib << 20
    for kind in (("directory", "azure") if a.store == "both" else (a.store,)):
        tmp = Path(tempfile.mkdtemp(prefix=f"mem-{kind}-"))
        az = None
        try:
            if kind == "azure":
                az = Azurite(str(tmp / "azurite")).start()
                env = sidecar_env(SIDECAR_STORE=f"{az.url}/memory", AZURE_STORAGE_CONNECTION_STRING=connection_string(az.url))
            else:
                env = sidecar_env(SIDECAR_STORE=str(tmp / "store"))
            env["SIDECAR_MAX_FILE_SIZE"] = str(2 * size)  # the default (256 MiB) would skip the file
            env["SIDECAR_DRAIN_TIMEOUT"] = "1800"  # run exits with its child's code: flush it all first
            up, down = measure(env, tmp, size)
            print(f"{kind:9}  file {a.size_mib} MiB   peak RSS: upload {up:.0f} MiB, restore {down:.0f} MiB")
        finally:
            if az is not None:
                az.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
