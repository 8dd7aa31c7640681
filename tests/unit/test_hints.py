"""Hints (sidecar.hints): a watcher event for a file version that was skipped queues nothing."""

from __future__ import annotations

import os

from sidecar.hints import Hints
from sidecar.known import StoreState
from sidecar.paths import IgnoreRules, Root
from sidecar.queue import UPLOAD


class Marks:
    def __init__(self) -> None:
        self.marked: list[tuple[str, object]] = []

    def mark(self, key, kind) -> None:
        self.marked.append((key, kind))

    def is_pending(self, key) -> bool:
        return False

    def pending_keys(self) -> set[str]:
        return set()


def test_an_event_for_the_skipped_version_queues_nothing_and_a_write_does(tmp_path):
    root = Root(".checkpoints", str(tmp_path))
    path = tmp_path / "big.json"
    path.write_bytes(b"small-stale\n")
    known, marks = StoreState(), Marks()
    hints = Hints([root], IgnoreRules(), known, marks)
    st = os.lstat(path)
    known.skip(".checkpoints/big.json", (st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    hints.mark_paths([str(path)])
    assert marks.marked == []
    path.write_bytes(b"the host's own\n")
    hints.mark_paths([str(path)])
    assert marks.marked == [(".checkpoints/big.json", UPLOAD)]
