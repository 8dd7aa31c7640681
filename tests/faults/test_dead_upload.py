"""A sidecar SIGKILLed in the middle of a streamed upload (Azure, on Azurite), and the file then
shrinks under the streaming threshold: the next sidecar uploads it, whatever its size.

A file above 8 MiB goes up as staged 4 MiB blocks and one commit. The test holds the upload at the
proxy (tests/proxy.py) once its first block is in the store and kills the sidecar there, so the
blob is left with uncommitted blocks only (each request is slowed down, so that the hold
reliably comes before the next block); the host then writes a small version of the file. The
restarted sidecar (straight to Azurite) must store that version and drain cleanly (exit 0): the
dead upload's blocks never block a later Put Blob of the same name.
"""

from __future__ import annotations

import os
import signal

import anyio
import pytest
from azure.storage.blob.aio import BlobServiceClient

from support import Sidecar, wait_for, write_atomic
from tests.faults.faultkit import new_target, wait_converged_azure
from tests.proxy import Proxy

pytestmark = [pytest.mark.faults, pytest.mark.azure]


def uncommitted_blocks(conn: str, container: str, name: str) -> int:
    async def go() -> int:
        async with BlobServiceClient.from_connection_string(conn) as svc:
            blob = svc.get_container_client(container).get_blob_client(name)
            try:
                _, uncommitted = await blob.get_block_list("uncommitted")
            except Exception:  # nothing staged yet
                return 0
            return len(uncommitted)

    return anyio.run(go)


def test_a_file_that_shrinks_after_a_crash_mid_stream_is_uploaded(azurite, tmp_path):
    target = new_target(azurite, "dead")
    proxy = Proxy.before(azurite.url)
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    cps.mkdir(parents=True)
    big = cps / "state.bin"
    name = ".checkpoints/state.bin"
    sc = None
    try:
        sc = Sidecar(work, "sync", "--store", proxy.via(target.store_url), "--roots", str(cps),
                     env=target.env(proxy.via(azurite.url)))
        sc.wait_event("ready", 30)

        def first_block_stored() -> bool:
            if any(r.blob == name and "comp=block" in r.query and "blocklist" not in r.query and r.status == 201
                   for r in list(proxy.records)):
                proxy.set(hold=True)  # the next block (and the commit) wait here
                return True
            return False

        proxy.set(latency=1.0)  # every request waits a second: time enough to hold the next block
        write_atomic(big, os.urandom(12 * 1024 * 1024 + 5))  # three blocks
        wait_for(first_block_stored, 60, "the first block of the streamed upload", interval=0.002)
        sc.kill()  # SIGKILL mid-stream: staged blocks, no commit
        assert uncommitted_blocks(target.conn, target.container, name) >= 1
        assert name not in target.all_blobs(with_data=False)

        small = os.urandom(3000)
        write_atomic(big, small)  # the host's next version is small: one Put Blob
        sc = Sidecar(work, "sync", "--store", target.store_url, "--roots", str(cps), env=target.env())
        sc.wait_event("ready", 30)
        wait_converged_azure(target, cps, 60, "the small version to be stored over the dead upload's blocks")
        assert target.tree()["state.bin"] == small
        assert sc.stop(signal.SIGTERM) == 0, sc.log()[-3000:]  # flushed: nothing left pending
        assert uncommitted_blocks(target.conn, target.container, name) == 0
    finally:
        proxy.set(hold=False)
        if sc is not None:
            sc.kill()
        proxy.stop()
        target.drop()
