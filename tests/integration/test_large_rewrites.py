"""A 5 MiB store file rewritten ten times a second: the newest version wins, nothing torn is stored."""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import threading
import time

import pytest

from support import Sidecar, wait_for

SIZE = 5 * 1024 * 1024


def version_blob(n: int) -> bytes:
    body = os.urandom(SIZE - 40)
    return struct.pack(">Q", n) + hashlib.sha256(body).digest() + body


def check_blob(data: bytes) -> int:
    """The version number of a complete blob; fails on a torn one."""
    assert len(data) == SIZE, f"torn: {len(data)} bytes"
    n, digest = struct.unpack(">Q", data[:8])[0], data[8:40]
    assert hashlib.sha256(data[40:]).digest() == digest, f"torn: version {n} fails its checksum"
    return n


@pytest.mark.slow  # ten rewrites a second for seconds: a load, in CI's second tier
@pytest.mark.parametrize("commit", ["per-file", "snapshot"])
def test_growing_file_rewritten_ten_times_a_second(work, commit):
    work, store = work
    state = work / "state" / "state_stores"
    state.mkdir(parents=True)
    target = state / "Y2hlY2twb2ludHM.json"
    stored = store / "state" / "state_stores" / target.name
    sc = Sidecar(work, "sync", "--store", str(store), "--roots", str(work / "state"), "--commit", commit)
    sc.wait_event("ready")
    stop = threading.Event()
    seen: list[int] = []

    def sample():  # read what the store holds, as a restore would, while the writes go on
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):
                seen.append(check_blob(stored.read_bytes()))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        last = 0
        for n in range(1, 31):  # 3 s at 10 writes/s, temp file + os.replace like the host
            tmp = state / f".{target.name}.{n}.tmp"
            tmp.write_bytes(version_blob(n))
            os.replace(tmp, target)
            last = n
            time.sleep(0.1)  # the workload's pace, not a synchronisation
        wait_for(lambda: stored.exists() and stored.read_bytes() == target.read_bytes(), 15,
                 "the newest version in the store")
    finally:
        stop.set()
        sampler.join()
        assert sc.stop() == 0
    assert check_blob(stored.read_bytes()) == last
    assert seen == sorted(seen), "an older version replaced a newer one"
