"""The pending set: coalescing per path, one operation per path, the delete barrier. No I/O, no sleeps."""

from sidecar.queue import DELETE, UPLOAD, PendingSet


def drain_order(ps: PendingSet) -> list[tuple[str, str]]:
    out = []
    while (op := ps.take()) is not None:
        out.append((op.kind, op.key))
        ps.done(op)
    return out


def test_coalesces_per_path():
    ps = PendingSet()
    for _ in range(1000):
        ps.mark("a", UPLOAD)
    ps.mark("b", UPLOAD)
    assert len(ps) == 2
    assert drain_order(ps) == [(UPLOAD, "a"), (UPLOAD, "b")]
    assert ps.idle()


def test_newest_intent_wins():
    ps = PendingSet()
    ps.mark("a", UPLOAD)
    ps.mark("a", DELETE)
    assert drain_order(ps) == [(DELETE, "a")]
    ps.mark("a", DELETE)
    ps.mark("a", UPLOAD)
    assert drain_order(ps) == [(UPLOAD, "a")]


def test_one_operation_per_path_at_a_time():
    ps = PendingSet()
    ps.mark("a", UPLOAD)
    first = ps.take()
    ps.mark("a", UPLOAD)  # changed again while being uploaded
    assert ps.take() is None  # must wait: an older version may not land after a newer one
    ps.done(first)
    second = ps.take()
    assert second is not None and second.key == "a"
    ps.done(second)
    assert ps.idle()


def test_delete_waits_for_earlier_uploads():
    # the host writes checkpoint B, then deletes checkpoint A
    ps = PendingSet()
    ps.mark("ctx/B.json", UPLOAD)
    ps.mark("ctx/A.json", DELETE)
    up = ps.take()
    assert (up.kind, up.key) == (UPLOAD, "ctx/B.json")
    assert ps.take() is None  # the delete is held while B is not durable
    ps.done(up)
    rm = ps.take()
    assert (rm.kind, rm.key) == (DELETE, "ctx/A.json")


def test_delete_not_held_by_later_uploads():
    ps = PendingSet()
    ps.mark("A", DELETE)
    ps.mark("B", UPLOAD)
    ops = [ps.take(), ps.take()]
    assert {(o.kind, o.key) for o in ops} == {(DELETE, "A"), (UPLOAD, "B")}


def test_barrier_remembers_oldest_unflushed_change():
    # B written (seq1), A deleted (seq2), B written again (seq3) before its first upload started:
    # the delete must still wait for B, whose first change predates it.
    ps = PendingSet()
    ps.mark("B", UPLOAD)
    ps.mark("A", DELETE)
    ps.mark("B", UPLOAD)
    first = ps.take()
    assert first.key == "B"
    assert ps.take() is None
    ps.done(first)
    assert ps.take().key == "A"


def test_delete_waits_for_upload_rescheduled_after_in_flight():
    ps = PendingSet()
    ps.mark("B", UPLOAD)
    up = ps.take()
    ps.mark("A", DELETE)
    assert ps.take() is None
    ps.retry(up)  # failed: still owed, and older than the delete
    again = ps.take()
    assert again.key == "B"
    assert ps.take() is None
    ps.done(again)
    assert ps.take().key == "A"


def test_retry_keeps_place_and_newest_intent():
    ps = PendingSet()
    ps.mark("a", UPLOAD)
    op = ps.take()
    ps.mark("a", DELETE)
    ps.retry(op)
    nxt = ps.take()
    assert (nxt.kind, nxt.key) == (DELETE, "a")
    assert nxt.first_seq == op.first_seq


def test_many_paths_scale_linearly():
    ps = PendingSet()
    n = 100_000
    for i in range(n):
        ps.mark(f"f{i}", UPLOAD)
    ps.mark("old", DELETE)
    taken = 0
    while (op := ps.take()) is not None:
        taken += 1
        ps.done(op)
    assert taken == n + 1 and ps.idle()


def test_a_held_delete_written_again_is_uploaded_not_left_behind_the_barrier():
    ps = PendingSet()
    ps.mark("u", UPLOAD)
    u = ps.take()  # an upload in flight
    ps.mark("k", UPLOAD)
    ps.mark("d2", DELETE)
    ps.mark("k", DELETE)
    assert ps.take() is None  # both deletes wait for u
    ps.mark("k", UPLOAD)  # k is written again: an upload, which never waits for the barrier
    ps.done(u)
    k = ps.take()
    assert k is not None and (k.key, k.kind) == ("k", UPLOAD)
    assert ps.take() is None  # d2 waits for k (owed since before d2 was deleted)
    ps.done(k)
    d2 = ps.take()
    assert d2 is not None and (d2.key, d2.kind) == ("d2", DELETE)


def test_random_schedules_never_stall():
    """Whatever the order of marks, takes, completions and retries: while nothing runs, any work
    owed can start (a stall leaves changes unmirrored for good), and the whole set drains."""
    import random

    for seed in range(300):
        rng = random.Random(seed)
        ps = PendingSet()
        keys = [f"k{i}" for i in range(6)]
        running: list = []
        for _ in range(200):
            r = rng.random()
            if r < 0.45:
                ps.mark(rng.choice(keys), rng.choice((UPLOAD, DELETE)))
            elif r < 0.7:
                op = ps.take()
                if op is not None:
                    running.append(op)
            elif running:
                op = running.pop(rng.randrange(len(running)))
                (ps.retry if rng.random() < 0.2 else ps.done)(op)
            if not running and ps.pending:
                op = ps.take()
                assert op is not None, f"seed {seed}: stalled with {sorted(ps.pending)} pending"
                running.append(op)
        for _ in range(1000):  # drain
            if running:
                ps.done(running.pop(0))
            elif (op := ps.take()) is not None:
                running.append(op)
            else:
                break
        assert ps.idle(), f"seed {seed}: {sorted(ps.pending)} left pending"
