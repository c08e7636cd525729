"""One autoscaling evaluation of an InferenceService: observe, decide (pure), actuate, report."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvpilot.operator.autoscaler.decision import Decision, Policy, Recommendation, decide
from kvpilot.operator.autoscaler.promql import MetricsUnavailable, PrometheusSource
from kvpilot.operator.builders.manifests import selector_labels
from kvpilot.operator.crd_types import InferenceServiceSpec, InferenceServiceStatus, MetricsSnapshot, ScalingEvent
from kvpilot.operator.kube import Kube
from kvpilot.operator.status import now_rfc3339, set_condition

log = logging.getLogger("kvpilot.autoscaler")
HISTORY_LENGTH = 10


@dataclass
class AutoscalerState:
    """Per InferenceService, in memory: when it was last evaluated and the recommendation history."""

    last_eval: float = 0.0
    history: list[Recommendation] = field(default_factory=list)


def _is_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in pod.get("status", {}).get("conditions", []) or [])


def live_pods(pods: list[dict]) -> list[dict]:
    """Pods that serve or will: not being deleted, and not over (Failed, e.g. evicted, or Succeeded), which
    would otherwise count as "starting" for ever and block every scale-up."""
    return [p for p in pods if not p["metadata"].get("deletionTimestamp") and (p.get("status") or {}).get("phase") not in ("Failed", "Succeeded")]


def policy_of(spec: InferenceServiceSpec) -> Policy:
    a = spec.autoscaling
    return Policy(spec.min_replicas, spec.max_replicas, a.target_kv_cache_utilization, a.target_queue_depth, a.tolerance,
                  float(a.scale_down_stabilization_seconds), float(a.metrics_stale_after_seconds or 3 * a.interval_seconds))


def evaluate(kube: Kube, source: PrometheusSource, body: dict, state: AutoscalerState, now: float | None = None) -> Decision | None:
    """Returns the decision made, or None when it was not time yet or autoscaling is off."""
    now = time.time() if now is None else now
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    spec = InferenceServiceSpec.model_validate(body["spec"])
    if not spec.autoscaling.enabled:
        _report(kube, body, None, spec, note=("False", "Disabled", "autoscaling is off: spec.replicas is honoured as set"))
        return None
    if now - state.last_eval < spec.autoscaling.interval_seconds:
        return None
    state.last_eval = now
    selector = ",".join(f"{k}={v}" for k, v in selector_labels(name).items())
    pods = live_pods(kube.list("v1", "Pod", namespace, selector))
    ready = [p["metadata"]["name"] for p in pods if _is_ready(p)]
    starting = len(pods) - len(ready)
    current = spec.replicas if spec.replicas is not None else spec.min_replicas
    error, samples = None, []
    try:
        samples = source.pod_samples(spec.engine, namespace, name)
    except MetricsUnavailable as e:
        error = str(e)
    decision = decide(now, current, ready, starting, samples, policy_of(spec), state.history, error)
    state.history = decision.history
    if decision.desired != current:
        kube.scale_isvc(name, namespace, decision.desired)
        kind = "ScaledUp" if decision.desired > current else "ScaledDown"
        kube.event(body, "Normal", kind, decision.reason)
        log.info("%s/%s: %s", namespace, name, decision.reason)
    _report(kube, body, decision, spec, current=current)
    return decision


def _report(kube: Kube, body: dict, decision: Decision | None, spec: InferenceServiceSpec, current: int | None = None,
            note: tuple[str, str, str] | None = None) -> None:
    """Write the autoscaler's part of status (fresh read first: reconcile writes status too)."""
    from kvpilot.operator.reconcile import isvc_lock

    meta = body["metadata"]
    with isvc_lock(meta["namespace"], meta["name"]):
        fresh = kube.get_isvc(meta["name"], meta["namespace"])
        if fresh is None:
            return
        raw = fresh.get("status") or {}
        status = InferenceServiceStatus.model_validate(raw) if raw else InferenceServiceStatus()
        stamp = now_rfc3339()
        gen = fresh["metadata"].get("generation")
        if decision is None:
            status.conditions = set_condition(status.conditions, "ScalingActive", *note, gen, stamp)
        else:
            status.desired_replicas = decision.desired
            status.last_metrics = MetricsSnapshot(
                kv_cache_utilization=f"{decision.mean_kv:.2f}" if decision.mean_kv is not None else None,
                queue_depth=f"{decision.mean_queue:.2f}" if decision.mean_queue is not None else None,
                pods=decision.pods_with_metrics, time=stamp)
            status.conditions = set_condition(status.conditions, "ScalingActive", "True" if decision.scaling_active else "False",
                                              decision.active_reason, decision.reason, gen, stamp)
            if current is not None and decision.desired != current:
                status.last_scale_time = stamp
                status.scaling_history = (status.scaling_history + [ScalingEvent(time=stamp, from_replicas=current, to_replicas=decision.desired,
                                                                                 reason=decision.reason)])[-HISTORY_LENGTH:]
        new = status.model_dump(by_alias=True, exclude_none=True, mode="json")
        if new != raw:
            kube.patch_isvc_status(meta["name"], meta["namespace"], new)
