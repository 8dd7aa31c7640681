"""GroupCommit, with gates only: callers that arrive while a write runs are covered by one more
write, of the highest value asked; nobody returns before a write covering it has completed; a
write that fails covers nobody."""

from __future__ import annotations

import anyio
import pytest

from sidecar.groupcommit import GroupCommit

pytestmark = pytest.mark.anyio


class GatedWrites:
    """Each write is recorded when it starts and completes once the test opens its gate."""

    def __init__(self, fail_first: bool = False) -> None:
        self.started: list[int] = []
        self.completed: list[int] = []
        self.gates: list[anyio.Event] = []
        self.fail_first = fail_first
        self.changed = anyio.Event()

    async def write(self, value: int) -> None:
        gate = anyio.Event()
        self.started.append(value)
        self.gates.append(gate)
        self.changed.set()
        await gate.wait()
        if self.fail_first and len(self.started) == 1:
            raise OSError("disk full")
        self.completed.append(value)

    async def until_started(self, n: int) -> None:
        with anyio.fail_after(5):
            while len(self.started) < n:
                self.changed = anyio.Event()
                await self.changed.wait()


async def test_callers_arriving_during_a_write_share_the_next_one():
    w = GatedWrites()
    commit = GroupCommit(w.write)
    returned: list[tuple[int, list[int]]] = []  # (value, the writes completed when it returned)

    async def caller(n: int) -> None:
        await commit.cover(n)
        returned.append((n, list(w.completed)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller, 1)
        await w.until_started(1)
        for n in range(2, 12):  # ten more arrive while the first write runs
            tg.start_soon(caller, n)
        await anyio.wait_all_tasks_blocked()
        assert w.started == [1] and returned == []
        w.gates[0].set()
        await w.until_started(2)
        await anyio.wait_all_tasks_blocked()
        assert returned == [(1, [1])]  # only the first: the others wait for the second write
        w.gates[1].set()
    assert w.started == [1, 11], "one write for the ten that waited, of the highest value"
    assert all(max(done) >= n for n, done in returned) and len(returned) == 11


async def test_a_value_already_covered_costs_no_write():
    w = GatedWrites()
    commit = GroupCommit(w.write)
    async with anyio.create_task_group() as tg:
        tg.start_soon(commit.cover, 5)
        await w.until_started(1)
        w.gates[0].set()
    await commit.cover(3)
    await commit.cover(5)
    assert w.started == [5]


async def test_a_failed_write_covers_nobody_and_the_next_caller_writes_again():
    w = GatedWrites(fail_first=True)
    commit = GroupCommit(w.write)
    errors: list[BaseException] = []

    async def first() -> None:
        try:
            await commit.cover(1)
        except OSError as e:
            errors.append(e)

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await w.until_started(1)
        tg.start_soon(commit.cover, 2)
        await anyio.wait_all_tasks_blocked()
        w.gates[0].set()
        await w.until_started(2)
        w.gates[1].set()
    assert [type(e) for e in errors] == [OSError]
    assert w.started == [1, 2] and w.completed == [2] and commit.written == 2
