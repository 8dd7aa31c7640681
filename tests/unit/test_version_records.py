"""The daemon's lineage records and their version (outside tester, round 4): a due root whose
record is being written while a raise waits for the records' lock is rewritten by that raise, so
no record is left below a version already sent. Gates only: the due root's write is held until
the raise waits."""

from __future__ import annotations

import threading

import anyio
import pytest

import sidecar.restore.finish as finish
from sidecar import log
from sidecar.daemon import Daemon
from sidecar.groupcommit import GroupCommit
from sidecar.paths import Root
from sidecar.restorefs import Lineage, read_lineage, write_lineage

pytestmark = pytest.mark.anyio


class Ledger:
    def __init__(self) -> None:
        self.lineage_due = {"a"}
        self.incomplete: set[str] = set()
        self.unproven: set[str] = set()

    def recorded(self, name: str) -> None:
        self.lineage_due.discard(name)


async def test_a_root_recorded_while_a_raise_waits_is_raised_too(tmp_path, monkeypatch):
    a, b = Root("a", str(tmp_path / "a")), Root("b", str(tmp_path / "b"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    lineage = Lineage("mem://x", "", 1, 1)
    write_lineage(b, lineage)
    d = Daemon.__new__(Daemon)  # only what the records' rules use
    d.roots, d.ledger, d.lineage = [a, b], Ledger(), lineage
    d._records, d._version_unrecorded = anyio.Lock(), log.Once()
    d._version_records = GroupCommit(d._write_version)
    started, release = threading.Event(), threading.Event()

    def held_write(root, lin, durable=True):
        started.set()
        assert release.wait(10)
        return write_lineage(root, lin, durable=durable)

    monkeypatch.setattr(finish, "write_lineage", held_write)
    async with anyio.create_task_group() as tg:
        tg.start_soon(d._record_due, [a])  # the root's first file: its record written, held
        with anyio.fail_after(10):
            while not started.is_set():
                await anyio.sleep(0.005)  # a poll's pace
        tg.start_soon(d._version_records.cover, 5)  # a put at version 5, waiting for the lock
        await anyio.wait_all_tasks_blocked()
        release.set()
    assert read_lineage(b).version == 5
    assert read_lineage(a).version == 5, "a record below a version already sent"
