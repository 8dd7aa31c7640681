"""A process SIGKILLed while it writes a restore point to the directory store: the point never
becomes visible, and neither the fast restore nor ``restore --as-of`` uses any of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio

from sidecar.paths import Root
from sidecar.restore.latest import restore
from sidecar.store.directory import DirectoryStore
from support import REPO, disk_tree, seed_directory_store, wait_for

#: Writes a full point of the store's objects plus a 64 MiB file streamed slowly (its second
#: read, the put's: the first only measures it), through the real store; prints "putting" first.
WRITER = textwrap.dedent("""
    import hashlib, sys, time, anyio
    from sidecar.points.format import PointEntry, PointHeader, point_key, point_source
    from sidecar.store.base import ObjectMeta
    from sidecar.store.directory import DirectoryStore

    CHUNK, CHUNKS = 1024 * 1024, 64
    class Slow:
        reads = 0
        def iter_sync(self):
            Slow.reads += 1
            if Slow.reads == 2:
                print("putting", flush=True)
            for _ in range(CHUNKS):
                if Slow.reads > 1:
                    time.sleep(0.05)
                yield b"x" * CHUNK

    async def main():
        store = DirectoryStore(sys.argv[1])
        await store.open()
        entries, data = [], {}
        async for info in store.list(".checkpoints/"):
            body, _ = await store.get(info.key)
            data[info.key] = body
            entries.append(PointEntry(info.key, ObjectMeta(info.size, info.sha256, info.mtime_ns, info.mode, info.version)))
        big = hashlib.sha256(b"x" * CHUNK * CHUNKS).hexdigest()
        entries.append(PointEntry(".checkpoints/big", ObjectMeta(CHUNK * CHUNKS, big, 0, 0o600, 0)))
        data[".checkpoints/big"] = Slow()
        header = PointHeader("full", 100, 100, 100, tuple(entries))
        source = await anyio.to_thread.run_sync(point_source, header, data)
        await store.put(point_key("full", 100, 100), source, ObjectMeta(source.size, source.sha256, 0, 0o600, 100))
        print("stored", flush=True)

    anyio.run(main)
""")


def test_a_point_whose_writer_is_killed_mid_put_is_never_used(tmp_path):
    store = tmp_path / "store"
    files = {f".checkpoints/r/{i}.json": os.urandom(500) for i in range(10)}
    seed_directory_store(store, files)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(store)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "putting"
        # the put is under way: its temp file in the store grows
        wait_for(lambda: [p for p in store.rglob(".sidecar-tmp-*") if p.stat().st_size > 4 * 1024 * 1024], 20,
                 "the point's temp file in the store")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    assert not list(store.rglob("*.tar")), "a point cut short by SIGKILL became visible"

    async def go():
        s = DirectoryStore(str(store))
        await s.open()
        from sidecar.restore.points import list_points

        assert await list_points(s) == {}
        root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
        _, result = await restore(s, [root])
        return root, result

    root, result = anyio.run(go)
    assert result.from_points == 0 and result.files == len(files)
    assert disk_tree(Path(root.path)) == {k.removeprefix(".checkpoints/"): v for k, v in files.items()}
