"""Prometheus metrics (``prometheus-client``), all prefixed ``checkpoint_sidecar_``.

One registry per process; labels never carry paths or secrets (bounded cardinality).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics

disable_created_metrics()  # no *_created series: one more per counter, of no use on a dashboard
REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY, namespace="checkpoint_sidecar")

_P = "checkpoint_sidecar_"

UPLOADS = Counter(_P + "uploaded_files", "Files stored durably", registry=REGISTRY)
UPLOAD_BYTES = Counter(_P + "uploaded_bytes", "Bytes stored durably", registry=REGISTRY)
DELETES = Counter(_P + "deleted_files", "Deletes mirrored to the store", registry=REGISTRY)
SKIPPED = Counter(_P + "skipped_files", "Files not mirrored, by reason", ["reason"], registry=REGISTRY)
PENDING = Gauge(_P + "pending_paths", "Paths waiting to be uploaded or deleted", registry=REGISTRY)
FAILURES = Counter(_P + "failures", "Failed store operations, by kind", ["kind"], registry=REGISTRY)
RETRIES = Counter(_P + "retries", "Store operations retried after a transient failure", registry=REGISTRY)
LAST_SYNC = Gauge(_P + "last_sync_timestamp_seconds", "Unix time the pending set was last empty", registry=REGISTRY)
READY = Gauge(_P + "ready", "1 while /readyz answers 200 (restored and mirroring), else 0", registry=REGISTRY)
FENCED = Gauge(_P + "fenced", "1 when a newer sidecar owns the store prefix and this one stopped writing", registry=REGISTRY)
DEGRADED = Gauge(_P + "store_degraded", "1 while the store is failing and work is being retried", registry=REGISTRY)
LATENCY = Histogram(
    _P + "write_to_durable_seconds",
    "From a file change being seen to the object being stored",
    buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)
RECONCILES = Counter(_P + "reconciles", "Reconciliation passes, by kind (local, full)", ["kind"], registry=REGISTRY)
RECONCILE_FIXES = Counter(_P + "reconcile_fixes", "Differences found by reconciliation (missed events)", registry=REGISTRY)
WATCH_EVENTS = Counter(_P + "watch_events", "File change events received from the watcher", registry=REGISTRY)
RESTORE_SECONDS = Gauge(_P + "restore_duration_seconds", "Duration of the last restore", registry=REGISTRY)
RESTORED_FILES = Counter(_P + "restored_files", "Files restored from the store", registry=REGISTRY)
RESTORED_BYTES = Counter(_P + "restored_bytes", "Bytes restored from the store", registry=REGISTRY)
