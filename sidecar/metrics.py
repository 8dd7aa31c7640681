"""Prometheus metrics (``prometheus-client``), all prefixed ``checkpoint_sidecar_``.

One registry per process; labels never carry paths or secrets (bounded cardinality).

The registry is built on first use (PEP 562 module ``__getattr__``), not at import: importing
``prometheus_client`` is not free, and ``run`` starts its child before anything touches a metric.
The restore, which runs before the child starts, reports through :func:`restored` and
:func:`restore_finished`, which hold their figures until the registry exists.
"""

from __future__ import annotations

from typing import Any

_P = "checkpoint_sidecar_"
_early: dict[str, Any] = {"files": 0, "bytes": 0, "seconds": None, "quarantined": 0}


def _build() -> dict[str, Any]:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics

    disable_created_metrics()  # no *_created series: one more per counter, of no use on a dashboard
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry, namespace="checkpoint_sidecar")
    r: dict[str, Any] = {"registry": registry}
    m: dict[str, Any] = {
        "REGISTRY": registry,
        "UPLOADS": Counter(_P + "uploaded_files", "Files stored durably", **r),
        "UPLOAD_BYTES": Counter(_P + "uploaded_bytes", "Bytes stored durably", **r),
        "DELETES": Counter(_P + "deleted_files", "Deletes mirrored to the store", **r),
        "SKIPPED": Counter(_P + "skipped_files", "Files not mirrored, by reason", ["reason"], **r),
        "PENDING": Gauge(_P + "pending_paths", "Paths waiting to be uploaded or deleted", **r),
        "FAILURES": Counter(_P + "failures", "Failed store operations, by kind", ["kind"], **r),
        "RETRIES": Counter(_P + "retries", "Store operations retried after a transient failure", **r),
        "LAST_SYNC": Gauge(_P + "last_sync_timestamp_seconds", "Unix time the pending set was last empty", **r),
        "READY": Gauge(_P + "ready", "1 while /readyz answers 200 (restored and mirroring), else 0", **r),
        "FENCED": Gauge(_P + "fenced", "1 when a newer sidecar owns the store prefix and this one stopped writing", **r),
        "DEGRADED": Gauge(_P + "store_degraded", "1 while the store is failing and work is being retried", **r),
        "LATENCY": Histogram(
            _P + "write_to_durable_seconds",
            "From a file change being seen to the object being stored",
            buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            **r,
        ),
        "RECONCILES": Counter(_P + "reconciles", "Reconciliation passes, by kind (local, full)", ["kind"], **r),
        "RECONCILE_FIXES": Counter(_P + "reconcile_fixes", "Differences found by reconciliation (missed events)", **r),
        "WATCH_EVENTS": Counter(_P + "watch_events", "File change events received from the watcher", **r),
        "RESTORE_SECONDS": Gauge(_P + "restore_duration_seconds", "Duration of the last restore", **r),
        "RESTORED_FILES": Counter(_P + "restored_files", "Files restored from the store", **r),
        "RESTORED_BYTES": Counter(_P + "restored_bytes", "Bytes restored from the store", **r),
        "WATCH_POLLING": Gauge(_P + "watch_polling", "1 while the roots are rescanned on a timer because an inotify "
                               "limit (max_user_instances, max_user_watches) is used up, else 0", **r),
        "ROOTS_UNREADABLE": Gauge(_P + "roots_unreadable", "Roots that cannot be read, or are gone as a whole (removed, "
                                  "replaced, a mount gone) while the store holds their files: their stored files are "
                                  "kept, never deleted for it; not ready while above 0", **r),
        "FENCE_WAIT": Gauge(_P + "fence_wait_seconds", "Seconds the uploads waited (at the claim) for a previous "
                            "owner's write window; 0 when it had released the namespace", **r),
        "QUARANTINED": Counter(_P + "restore_quarantined_objects", "Corrupt stored objects left out of a restore "
                               "(SIDECAR_RESTORE_CORRUPT=skip); kept in the store, never deleted", **r),
        "POINTS": Counter(_P + "restore_points", "Restore points written, by kind (full, incr)", ["kind"], **r),
        "POINT_BYTES": Counter(_P + "restore_point_bytes", "Bytes of the restore points written", **r),
        "POINT_DELETES": Counter(_P + "restore_point_deletes", "Expired restore points deleted by retention", **r),
        "LAST_POINT": Gauge(_P + "last_restore_point_timestamp_seconds",
                            "Store time (Last-Modified) of the last restore point written", **r),
    }
    m["QUARANTINED"].inc(_early["quarantined"])
    m["RESTORED_FILES"].inc(_early["files"])
    m["RESTORED_BYTES"].inc(_early["bytes"])
    if _early["seconds"] is not None:
        m["RESTORE_SECONDS"].set(_early["seconds"])
    return m


def __getattr__(name: str) -> Any:
    if name.startswith("_") or not name.isupper():
        raise AttributeError(name)
    if "REGISTRY" not in globals():
        globals().update(_build())
    try:
        return globals()[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def loaded() -> bool:
    return "REGISTRY" in globals()


def restored(nbytes: int) -> None:
    """One file restored (counted now if the registry exists, else when it is built)."""
    if loaded():
        __getattr__("RESTORED_FILES").inc()
        __getattr__("RESTORED_BYTES").inc(nbytes)
    else:
        _early["files"] += 1
        _early["bytes"] += nbytes


def quarantined() -> None:
    """One corrupt object left out of the restore (counted now, or when the registry is built)."""
    if loaded():
        __getattr__("QUARANTINED").inc()
    else:
        _early["quarantined"] += 1


def restore_finished(seconds: float) -> None:
    if loaded():
        __getattr__("RESTORE_SECONDS").set(seconds)
    else:
        _early["seconds"] = seconds


class Totals:
    """What this process stored and deleted: counted in the metrics, and summed for the shutdown
    summary line (:attr:`summary`)."""

    def __init__(self) -> None:
        self.summary = {"uploaded": 0, "bytes": 0, "deleted": 0}

    def uploaded(self, size: int) -> None:
        self.summary["uploaded"] += 1
        self.summary["bytes"] += size
        __getattr__("UPLOADS").inc()
        __getattr__("UPLOAD_BYTES").inc(size)

    def deleted(self) -> None:
        self.summary["deleted"] += 1
        __getattr__("DELETES").inc()
