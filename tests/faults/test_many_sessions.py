"""Many sessions on one store: 20 ``run`` wrappers of one configuration at once, on both stores.

Each session's child writes checkpoints the way the agent host does (temp file, ``os.replace``,
the previous checkpoint pruned) into its own compute's directory; only
``FOUNDRY_AGENT_SESSION_ID`` tells the sessions apart. Then half of them lose their disks and
start again. Checked: nothing crosses between namespaces, nobody is fenced, every session's
namespace ends byte-exact with its disk, and every restarted session gets back exactly its own
files. Printed (for ``bench/RESULTS.md``): per-sidecar peak RSS and CPU, and on Azure the store
requests per checkpoint write, counted from the emulator's own request log.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from support import Sidecar, disk_tree, sidecar_env, wait_for
from tests.azurite import answers, connection_string, find_azurite_command, free_port, wait_until
from tests.faults.faultkit import AzureTarget

pytestmark = pytest.mark.faults

SESSIONS = int(os.environ.get("SOAK_SESSIONS", "8"))  # CI's; the nightly run's figures take 20
NIGHTLY_SESSIONS = 20
WRITES = int(os.environ.get("SOAK_SESSION_WRITES", "12"))
AGENT = "soak"

CHILD = f"""
import json, os, random, signal, sys, time, uuid
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
sid = os.environ["FOUNDRY_AGENT_SESSION_ID"]
rng = random.Random(sid)
previous = None
for i in range({WRITES}):
    if i % 4 == 0:  # a new turn: a new response directory; the last one keeps its newest checkpoint
        turn, previous = os.path.join(".checkpoints", f"resp_{{sid}}_{{i}}"), None
        os.makedirs(turn, exist_ok=True)
    path = os.path.join(turn, uuid.uuid4().hex + ".json")
    with open(path + ".tmp", "w") as f:
        json.dump({{"session": sid, "turn": i, "pad": "x" * rng.randint(100, 20000)}}, f)
    os.replace(path + ".tmp", path)
    if previous:
        os.unlink(previous)
    previous = path
    time.sleep(rng.uniform(0.005, 0.03))
open("done", "w").close()
signal.pause()
"""


class EmulatorWithRequestLog:
    """An Azurite of this test's own whose debug log names every request it served."""

    def __init__(self, tmp: Path) -> None:
        self.location = tmp / "azurite"
        self.location.mkdir()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/devstoreaccount1"
        self.debug = self.location / "debug.log"
        self.proc = subprocess.Popen(
            find_azurite_command() + ["--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location",
                                      str(self.location), "--skipApiVersionCheck", "--disableTelemetry", "--silent",
                                      "--debug", str(self.debug)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_until(lambda: answers(self.url, 0.5), 30, what="Azurite")

    def requests(self) -> list[tuple[str, str]]:
        """(method, path) of every request so far."""
        pattern = re.compile(r"RequestMethod=(\w+) RequestURL=http://[^/]+(/\S*)")
        text = self.debug.read_text(errors="replace") if self.debug.exists() else ""
        return [(m.group(1), m.group(2).split("?", 1)[0]) for m in pattern.finditer(text)]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _proc_usage(pid: int) -> tuple[float, float]:
    """(peak RSS in MiB, CPU seconds) of a live process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    hwm = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return hwm, cpu


@pytest.mark.slow
@pytest.mark.parametrize("sessions", [SESSIONS, pytest.param(NIGHTLY_SESSIONS, marks=pytest.mark.nightly)])
@pytest.mark.parametrize("kind", ["directory", pytest.param("azure", marks=pytest.mark.azure)])
def test_many_live_sessions_on_one_store_keep_apart(kind, sessions, tmp_path):
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    emulator = EmulatorWithRequestLog(tmp_path) if kind == "azure" else None
    container = "sessions"
    store = f"{emulator.url}/{container}" if emulator else str(tmp_path / "store")
    if not emulator:
        (tmp_path / "store").mkdir()  # a mounted volume: on a platform a missing store is refused
    cred = {"AZURE_STORAGE_CONNECTION_STRING": connection_string(emulator.url)} if emulator else {}
    sids = [f"sess-{n:02d}" for n in range(sessions)]
    works = {sid: tmp_path / sid for sid in sids}

    def env(sid: str) -> dict[str, str]:
        return sidecar_env(SIDECAR_STORE=store, FOUNDRY_AGENT_NAME=AGENT, FOUNDRY_AGENT_SESSION_ID=sid, **cred)

    def stored(sid: str) -> dict[str, bytes]:
        if emulator:
            return AzureTarget(emulator.url, container, f"{AGENT}/{sid}").tree(".checkpoints")
        return disk_tree(tmp_path / "store" / AGENT / sid / ".checkpoints")

    def everything_stored() -> set[str]:
        if emulator:
            return set(AzureTarget(emulator.url, container).all_blobs(with_data=False))
        top = tmp_path / "store"
        return {str(p.relative_to(top)) for p in top.rglob("*") if p.is_file() and ".sidecar-meta" not in p.parts}

    wrappers: dict[str, Sidecar] = {}
    try:
        for sid in sids:
            works[sid].mkdir()
            wrappers[sid] = Sidecar(works[sid], "run", "--", sys.executable, str(child), env=env(sid))
        wait_for(lambda: all((w / "done").exists() or wrappers[s].proc.poll() is not None for s, w in works.items()),
                 180, "every session's writes", interval=0.2)
        usage = {sid: _proc_usage(sc.proc.pid) for sid, sc in wrappers.items()}
        for sid, sc in wrappers.items():
            assert sc.stop() == 0, f"{sid}:\n{sc.log()[-3000:]}"
        requests = emulator.requests() if emulator else []  # the sidecars' own, before the checks read
        disks = {sid: disk_tree(works[sid] / ".checkpoints") for sid in sids}
        for sid, sc in wrappers.items():
            assert not sc.has_event("fenced"), f"{sid} was fenced:\n{sc.log()[-2000:]}"
            assert len(disks[sid]) == (WRITES + 3) // 4, disks[sid].keys()  # the newest of each turn
            assert all(f'"session": "{sid}"'.encode() in data for data in disks[sid].values())
            assert stored(sid) == disks[sid], sid
        outside = [k for k in everything_stored() if not re.match(rf"^{AGENT}/sess-\d\d/", k)]
        assert outside == []

        # half of the sessions lose their disks and start again
        for sid in sids[::2]:
            shutil.rmtree(works[sid])
            works[sid].mkdir()
            again = Sidecar(works[sid], "run", "--", sys.executable, "-c", "pass", env=env(sid))
            assert again.proc.wait(60) == 0, again.log()[-3000:]
            again.logf.close()
            assert disk_tree(works[sid] / ".checkpoints") == disks[sid], sid
        for sid in sids[1::2]:
            assert stored(sid) == disks[sid], sid
    finally:
        for sc in wrappers.values():
            sc.kill()
        if emulator:
            emulator.stop()

    rss = sorted(u[0] for u in usage.values())
    cpu = sorted(u[1] for u in usage.values())
    line = (f"\n{kind}: {sessions} sessions x {WRITES} checkpoint writes; per sidecar peak RSS median "
            f"{rss[len(rss) // 2]:.1f} MiB (max {rss[-1]:.1f}), CPU median {cpu[len(cpu) // 2]:.2f} s (max {cpu[-1]:.2f})")
    if requests:
        by_method = Counter(method for method, _path in requests)
        shapes = Counter(f"{m} {re.sub(r'[0-9a-f]{32}|sess-[0-9]+|resp_[^/]+', '*', p)}" for m, p in requests)
        line += (f"; store requests per checkpoint write {len(requests) / (sessions * WRITES):.2f} "
                 f"({', '.join(f'{m} {n}' for m, n in sorted(by_method.items()))} for {sessions * WRITES} writes; "
                 f"most: {', '.join(f'{k} x{n}' for k, n in shapes.most_common(4))})")
    print(line)
