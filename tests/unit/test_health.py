"""Health (sidecar.health) and what /livez and /readyz make of it (sidecar.http's checks)."""

from __future__ import annotations

import time

from sidecar.health import Health, Phase, RestorePhase
from sidecar.http import liveness, readiness


def test_phases_are_typed_and_read_as_their_names():
    h = Health()
    assert h.phase is Phase.STARTING and h.restore is RestorePhase.PENDING
    h.set(Phase.READY, "restored and mirroring")
    assert h.phase == "ready" and f"{h.phase}" == "ready" and h.ready
    assert liveness(h) == (False, "not live: uploader workers and watcher stopped")
    h.alive(workers=True, watcher=True)
    assert liveness(h) == (True, "live: ready")
    h.set(Phase.RESTORING, "restoring state from the store")
    assert liveness(Health()) == (True, "live: starting") and readiness(h) == (False, "not ready: restoring state from the store")


def test_an_unreadable_root_makes_it_unready_until_readable():
    h = Health(namespace="ns")
    h.set(Phase.READY, "restored and mirroring")
    h.root_readable("r", "cannot read /r: Permission denied")
    ok, why = readiness(h)
    assert not ok and why.startswith("not ready: cannot read /r: Permission denied (nothing of it")
    assert why.endswith("; namespace ns")
    h.root_readable("r", None)
    assert readiness(h) == (True, "ready: restored and mirroring; namespace ns")


def test_degradations_keep_it_ready_and_say_so():
    h = Health()
    h.set(Phase.READY, "restored and mirroring")
    h.store_degraded(time.monotonic() - 12.5)
    h.watch_polling("no inotify instance left", 1.0)
    first = h.polling
    h.watch_polling("another reason", 1.0)  # already polling: when it began stays
    assert h.polling is first
    ok, why = readiness(h)
    assert ok and why == ("ready: restored and mirroring; store degraded for 12s: store operations are failing and "
                          "being retried, changes are kept; watch degraded for 0s: polling every 1s, "
                          "no inotify instance left")
    h.store_degraded(None)
    h.watch_polling(None)
    assert readiness(h) == (True, "ready: restored and mirroring")


def test_the_watcher_tells_health_when_it_polls_and_when_it_watches_again():
    from sidecar import watcher

    told: list[tuple[str | None, float]] = []
    polling = watcher._Polling(lambda reason, every: told.append((reason, every)))
    polling.set(None)  # watching: nothing to tell
    polling.set("inotify watches used up")
    polling.set("inotify watches used up")  # said once
    polling.set(None)
    assert told == [("inotify watches used up", watcher.POLL_SECONDS), (None, watcher.POLL_SECONDS)]


def test_a_root_gone_as_a_whole_makes_it_unready_until_back():
    from sidecar import metrics

    h = Health(namespace="ns")
    h.set(Phase.READY, "restored and mirroring")
    h.root_gone("r", "the root /w/r\\n is gone (it no longer exists, or is not a directory): its 5 stored files are kept")
    h.root_readable("q", "cannot read /w/q: Permission denied")
    assert metrics.ROOTS_UNREADABLE._value.get() == 2
    ok, why = readiness(h)
    assert not ok and why == ("not ready: cannot read /w/q: Permission denied (nothing of it is mirrored: run the "
                              "sidecar as the host's user); the root /w/r\\n is gone (it no longer exists, or is not "
                              "a directory): its 5 stored files are kept; namespace ns")
    h.root_readable("q", None)
    h.root_gone("r", None)
    assert readiness(h) == (True, "ready: restored and mirroring; namespace ns")
    assert metrics.ROOTS_UNREADABLE._value.get() == 0
