"""The operator's own Prometheus metrics (served at /metrics beside /healthz): what it wants and sees
per InferenceService, its scaling decisions and its reconcile failures — the dashboard's replicas and
scaling-event panels and the autoscaler-metrics alert read these. Only the leader sets them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()
_LABELS = ["namespace", "inferenceservice"]
DESIRED = Gauge("kvpilot_operator_desired_replicas", "Engine pods the operator (autoscaler or spec.replicas) asks for.", _LABELS, registry=REGISTRY)
READY = Gauge("kvpilot_operator_ready_replicas", "Engine pods Ready, as the Deployment reports them.", _LABELS, registry=REGISTRY)
SCALINGS = Counter("kvpilot_operator_scaling_decisions", "Replica changes the autoscaler made, by direction (up, down).",
                   [*_LABELS, "direction"], registry=REGISTRY)
METRICS_AVAILABLE = Gauge("kvpilot_operator_autoscaler_metrics_available",
                          "1 when the autoscaler's last evaluation had usable engine metrics, 0 when they were unavailable, stale or missing.",
                          _LABELS, registry=REGISTRY)
RECONCILES = Counter("kvpilot_operator_reconciles", "Reconciles run.", _LABELS, registry=REGISTRY)
RECONCILE_ERRORS = Counter("kvpilot_operator_reconcile_errors", "Reconciles that failed with an exception (kopf retries them).",
                           _LABELS, registry=REGISTRY)
COLD_START = Histogram("kvpilot_operator_cold_start_seconds", "Engine pod starts, created to Ready, by phase (scheduling, model, import, "
                       "load, warmup, listen, ready; total: all of them).", ["phase"], registry=REGISTRY,
                       buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800))
_PER_SERVICE = (DESIRED, READY, METRICS_AVAILABLE, RECONCILES, RECONCILE_ERRORS)


def touch(namespace: str, name: str) -> None:
    """Counters of a service exist from its first reconcile, at 0: a panel or an alert over them then
    reads "none" rather than "no data"."""
    RECONCILE_ERRORS.labels(namespace, name)
    for direction in ("up", "down"):
        SCALINGS.labels(namespace, name, direction)


def forget(namespace: str, name: str) -> None:
    """An InferenceService is gone: its series go too (a dashboard must not show it for ever)."""
    for metric in _PER_SERVICE:
        try:
            metric.remove(namespace, name)
        except KeyError:
            pass
    for direction in ("up", "down"):
        try:
            SCALINGS.remove(namespace, name, direction)
        except KeyError:
            pass
