"""Snapshot commits stream: no file of a batch is held whole, on write or on restore.

Two large files in one snapshot batch are mirrored by ``run -- true`` (``SIDECAR_COMMIT=snapshot``:
a batch of two goes through a bundle), restored into an empty directory, and a bundle that a
cut-short commit left (in this release's format, and in the previous release's) is laid over the
per-file objects by a restore, on both stores, and the bytes round-trip. CI runs them just past the
streaming threshold; the ``nightly`` run at 96 MiB each, where the sidecar's peak RSS (``ru_maxrss``
from ``wait4``) is also held far below the files' size. Figures for 2 x 200 MiB live in
``bench/memory.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import anyio
import pytest

from support import json_lines, sidecar_env
from tests.faults.test_large_files import RSS_LIMIT_MIB, STREAMED, run_measured, sha

pytestmark = pytest.mark.faults

#: Each file of the nightly run; two of them in one batch. The sidecar itself needs far less than one.
SIZE = 96 * 1024 * 1024


def write_file(path: Path, seed: int, size: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    block = hashlib.sha256(str(seed).encode()).digest() * (1 << 15)  # 1 MiB, distinct per seed
    with open(path, "wb") as f:
        for i in range(0, size, 1 << 20):
            chunk = (i >> 20).to_bytes(8, "big") + block[8:min(1 << 20, size - i)]
            digest.update(chunk)
            f.write(chunk)
    return digest.hexdigest()


class FileStream:
    """A ``Source`` over bytes made by a generator function (never held whole)."""

    def __init__(self, make) -> None:
        self.make = make
        md5, self.size = hashlib.md5(), 0
        sha = hashlib.sha256()
        for chunk in make():
            md5.update(chunk)
            sha.update(chunk)
            self.size += len(chunk)
        self.md5, self.sha256 = md5.digest(), sha.hexdigest()

    def iter_sync(self):
        return self.make()

    async def chunks(self):
        for chunk in self.make():
            yield chunk


def v1_bundle(files: dict[str, Path]):
    """The previous release's bundle format: a JSON header line, then the files' bytes."""
    from sidecar.store.base import CHUNK_BYTES

    header = {"version": 1, "root": ".checkpoints", "entries": [
        {"key": key, "size": path.stat().st_size, "sha256": sha(path), "mtime_ns": 1_700_000_000_000_000_000,
         "mode": 0o600} for key, path in files.items()]}

    def make():
        yield json.dumps(header).encode() + b"\n"
        for path in files.values():
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    yield chunk

    return make


def v2_bundle(files: dict[str, Path]):
    from sidecar.localfs import hash_stable
    from sidecar.paths import Root
    from sidecar.snapshot import Change, bundle_chunks

    changes = []
    for key, path in files.items():
        root = Root(".checkpoints", str(path.parent))
        source, meta = hash_stable(root, [path.name], 2**40)
        changes.append(Change(key, source, meta))
    return lambda: bundle_chunks(".checkpoints", changes)


def put_bundle(store_url: str, make) -> None:
    from sidecar.snapshot import bundle_key
    from sidecar.store import make_store
    from sidecar.store.base import ObjectMeta

    async def go() -> None:
        store = make_store(store_url)
        await store.open()
        try:
            source = FileStream(make)
            # a later generation's bundle than the per-file objects' (the run's, generation 1):
            # only a bundle newer than an object replaces it at restore
            await store.put(bundle_key(".checkpoints"), source,
                            ObjectMeta(source.size, source.sha256, time.time_ns(), 0o600, version=5 << 40))
        finally:
            await store.aclose()

    anyio.run(go)


def round_trip(kind: str, size: int, tmp_path: Path, request, monkeypatch) -> dict[str, float]:
    """Two files of ``size`` in one snapshot commit by ``run -- true``, restored byte for byte, and
    cut-short bundles of both formats laid over them by a restore; the peak RSS (MiB) of each."""
    peaks: dict[str, float] = {}
    target = None
    if kind == "azure":
        from tests.faults.faultkit import new_target

        target = new_target(request.getfixturevalue("azurite"), "snapmem")
        env = target.env(SIDECAR_STORE=target.store_url)
        store_url = target.store_url
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", target.conn)
    else:
        store_url = str(tmp_path / "store")
        env = sidecar_env(SIDECAR_STORE=store_url)
    env.update(SIDECAR_COMMIT="snapshot", SIDECAR_DRAIN_TIMEOUT="600")
    try:
        src = tmp_path / "src"
        digests = {name: write_file(src / ".checkpoints" / name, n, size) for n, name in enumerate(["a.bin", "b.bin"])}
        code, peaks["commit"], err = run_measured(["run", "--", "true"], src, env)
        assert code == 0, err[-3000:]
        assert [e["uploaded"] for e in json_lines(err) if e.get("event") == "shutdown_flushed"] == [2], err[-2000:]

        fresh = tmp_path / "fresh"
        fresh.mkdir()
        code, peaks["restore"], err = run_measured(["restore"], fresh, env)
        assert code == 0, err[-3000:]
        assert {n: sha(fresh / ".checkpoints" / n) for n in digests} == digests

        # a commit cut short after its bundle was stored: the bundle holds newer versions
        newer = tmp_path / "newer"
        new_digests = {name: write_file(newer / name, 10 + n, size) for n, name in enumerate(["a.bin", "b.bin"])}
        files = {f".checkpoints/{name}": newer / name for name in new_digests}
        for fmt, make in (("v1", v1_bundle(files)), ("v2", v2_bundle(files))):
            put_bundle(store_url, make)
            laid = tmp_path / f"laid-{fmt}"
            laid.mkdir()
            code, peaks[f"restore of a {fmt} bundle"], err = run_measured(["restore"], laid, env)
            assert code == 0, err[-3000:]
            assert any(e.get("event") == "restore_bundle" for e in json_lines(err)), err[-2000:]
            assert {n: sha(laid / ".checkpoints" / n) for n in new_digests} == new_digests, fmt
    finally:
        if target is not None:
            target.drop()
        for p in tmp_path.rglob("*.bin"):
            os.unlink(p)
    print(f"\n{kind}: 2 x {size >> 20} MiB, peak RSS (MiB) {peaks}")
    return peaks


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["directory", pytest.param("azure", marks=pytest.mark.azure)])
def test_snapshot_commits_of_large_files_stream_both_ways(kind, tmp_path, request, monkeypatch):
    round_trip(kind, STREAMED, tmp_path, request, monkeypatch)


@pytest.mark.nightly
@pytest.mark.parametrize("kind", ["directory", pytest.param("azure", marks=pytest.mark.azure)])
def test_snapshot_commits_of_large_files_stream_in_bounded_memory(kind, tmp_path, request, monkeypatch):
    peaks = round_trip(kind, SIZE, tmp_path, request, monkeypatch)
    assert max(peaks.values()) < RSS_LIMIT_MIB, f"2 x {SIZE >> 20} MiB peaked at {peaks} MiB"


#: Files just under the streaming threshold (sent in one request each): enough for every worker.
MANY = 24
#: docs/BENCHMARKS.md#memory: baseline (90 MiB with the Azure SDK) + about 2.5 x (BODY_BUDGET +
#: concurrency x SMALL_BODY), whatever the number and size of the files.
MANY_RSS_LIMIT_MIB = 200


@pytest.mark.nightly  # a peak-RSS figure; the rule (ByteBudget) is tested in tests/unit/test_snapshot.py
@pytest.mark.parametrize("kind", ["directory", pytest.param("azure", marks=pytest.mark.azure)])
def test_many_files_just_under_the_streaming_threshold_take_bounded_memory(kind, tmp_path, request):
    from sidecar.localfs import STREAM_MIN

    target = None
    if kind == "azure":
        from tests.faults.faultkit import new_target

        target = new_target(request.getfixturevalue("azurite"), "manymem")
        env = target.env(SIDECAR_STORE=target.store_url)
    else:
        env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"))
    env["SIDECAR_DRAIN_TIMEOUT"] = "600"
    try:
        src = tmp_path / "src" / ".checkpoints"
        src.mkdir(parents=True)
        block = os.urandom(STREAM_MIN - 4096)
        for i in range(MANY):
            (src / f"f{i:02d}.bin").write_bytes(i.to_bytes(4, "big") + block[4:])
        code, rss, err = run_measured(["run", "--", "true"], src.parent, env)
        assert code == 0, err[-3000:]
        assert [e["uploaded"] for e in json_lines(err) if e.get("event") == "shutdown_flushed"] == [MANY], err[-2000:]
        assert rss < MANY_RSS_LIMIT_MIB, f"uploads of {MANY} x 8 MiB peaked at {rss:.0f} MiB"

        fresh = tmp_path / "fresh"
        fresh.mkdir()
        code, rss, err = run_measured(["restore"], fresh, env)
        assert code == 0, err[-3000:]
        assert sorted(p.name for p in (fresh / ".checkpoints").iterdir()) == sorted(p.name for p in src.iterdir())
        assert (fresh / ".checkpoints" / "f07.bin").read_bytes() == (src / "f07.bin").read_bytes()
        assert rss < MANY_RSS_LIMIT_MIB, f"restore of {MANY} x 8 MiB peaked at {rss:.0f} MiB"
    finally:
        if target is not None:
            target.drop()
