"""One autoscaling evaluation of an InferenceService: observe, decide (pure), actuate, report."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kvpilot.operator import metrics
from kvpilot.operator.autoscaler.decision import Decision, IdleTracker, Policy, Recommendation, decide, history_from_levels, observe_idle, window_levels
from kvpilot.operator.autoscaler.promql import MetricsUnavailable, PrometheusSource
from kvpilot.operator.builders.engines import served_name
from kvpilot.operator.builders.manifests import desired_prefill_replicas, is_prefill_pod, is_ready, selector_labels, serving_pods
from kvpilot.operator.cache import CACHE, POD
from kvpilot.operator.crd_types import (
    WAKE_ANNOTATION,
    InferenceServiceSpec,
    MetricsSnapshot,
    PoolStatus,
    RecommendationLevel,
    ScaleDownWindow,
    ScalingEvent,
)
from kvpilot.operator.kube import Kube
from kvpilot.operator.reconcile import PREFILL_REPORTS, REPORTS, refresh_status
from kvpilot.operator.status import AutoscalerReport, now_rfc3339

log = logging.getLogger("kvpilot.autoscaler")
HISTORY_LENGTH = 10


@dataclass
class AutoscalerState:
    """Per InferenceService, in memory: when it was last evaluated and the recommendation history (resumed
    from status.scaleDownWindow when this process starts leading: a leader change keeps the window)."""

    last_eval: float = 0.0
    history: list[Recommendation] = field(default_factory=list)
    idle: IdleTracker = field(default_factory=IdleTracker)
    resumed: bool = False
    since: float | None = None      # the first recommendation's time (the window is whole once it is a window old)
    # A disaggregated service's prefill pool: its own recommendations (not kept in status: a new leader's
    # prefill window starts again, which only delays a scale-down).
    prefill_history: list[Recommendation] = field(default_factory=list)


def live_pods(pods: list[dict]) -> list[dict]:
    """Pods that serve or will: not being deleted, and not over (Failed, e.g. evicted, or Succeeded), which
    would otherwise count as "starting" for ever and block every scale-up."""
    return [p for p in pods if not p["metadata"].get("deletionTimestamp") and (p.get("status") or {}).get("phase") not in ("Failed", "Succeeded")]


def policy_of(spec: InferenceServiceSpec) -> Policy:
    a = spec.autoscaling
    # Engine metrics never take a service below one pod: only idleness at the gateway scales to zero.
    return Policy(max(spec.min_replicas, 1), spec.max_replicas, a.target_kv_cache_utilization, a.target_queue_depth, a.tolerance,
                  float(a.scale_down_stabilization_seconds), float(a.metrics_stale_after_seconds or 3 * a.interval_seconds))


def prefill_policy_of(spec: InferenceServiceSpec) -> Policy:
    """The prefill pool scales on its queue depth: a KV-cache target of 1 never asks for more pods (a prefill pod's cache holds
    prompts only until their decode pods pull them)."""
    a, pool = spec.autoscaling, spec.disaggregation.prefill
    return Policy(pool.min_replicas, pool.max_replicas, 1.0, pool.target_queue_depth, a.tolerance,
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
    current = spec.replicas if spec.replicas is not None else spec.min_replicas
    if current == 0 and spec.min_replicas == 0:
        # Checked every pass, not every interval: a request is waiting at the gateway.
        requested = wake_requested(meta, body.get("status") or {})
        if requested is None:
            return None
        decision = Decision(1, f"scale up 0 -> 1: a request is waiting at the gateway (asked at {requested})", True, "ScaledFromZero")
        _actuate(kube, body, decision, current, spec)
        state.idle = IdleTracker()
        return decision
    if now - state.last_eval < spec.autoscaling.interval_seconds:
        return None
    state.last_eval = now
    policy = policy_of(spec)
    if not state.resumed:
        state.resumed = True
        saved = (body.get("status") or {}).get("scaleDownWindow")
        if saved and not state.history:
            window = ScaleDownWindow.model_validate(saved)
            state.since = _unix(window.since)
            state.history = history_from_levels(state.since, [(lv.replicas, _unix(lv.until)) for lv in window.levels], now)
    every_pod = live_pods(CACHE.with_labels(POD, namespace, selector_labels(name)))
    if spec.disaggregation is not None:
        _evaluate_prefill(kube, source, body, spec, [p for p in every_pod if is_prefill_pod(p)], state, now)
    pods = serving_pods(every_pod)
    ready = [p["metadata"]["name"] for p in pods if is_ready(p)]
    starting = len(pods) - len(ready)
    error, samples = None, []
    try:
        samples = source.pod_samples(spec.engine, namespace, name)
    except MetricsUnavailable as e:
        error = str(e)
    decision = decide(now, current, ready, starting, samples, policy, state.history, error)
    state.history = decision.history
    if state.since is None and state.history:
        state.since = state.history[0].time
    if spec.min_replicas == 0:
        _maybe_scale_to_zero(source, spec, name, namespace, state, decision, current, now)
    _actuate(kube, body, decision, current, spec, window_status(state, policy.scale_down_window, now))
    return decision


def _evaluate_prefill(kube: Kube, source: PrometheusSource, body: dict, spec: InferenceServiceSpec, pods: list[dict],
                      state: AutoscalerState, now: float) -> None:
    """The prefill pool's own decision (its queue depth, its bounds), written to spec.disaggregation.prefill.replicas."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    current = desired_prefill_replicas(spec)
    ready = [p["metadata"]["name"] for p in pods if is_ready(p)]
    error, samples = None, []
    try:
        samples = source.pod_samples(spec.engine, namespace, name, prefill=True)
    except MetricsUnavailable as e:
        error = str(e)
    decision = decide(now, current, ready, len(pods) - len(ready), samples, prefill_policy_of(spec), state.prefill_history, error)
    state.prefill_history = decision.history
    if decision.desired != current:
        kube.scale_prefill(name, namespace, decision.desired)
        kube.event(body, "Normal", "ScaledUp" if decision.desired > current else "ScaledDown", f"prefill pool: {decision.reason}")
        log.info("%s/%s: prefill pool: %s", namespace, name, decision.reason)
    report = PoolStatus(scaling=decision.reason, last_metrics=MetricsSnapshot(
        kv_cache_utilization=f"{decision.mean_kv:.2f}" if decision.mean_kv is not None else None,
        queue_depth=f"{decision.mean_queue:.2f}" if decision.mean_queue is not None else None, pods=decision.pods_with_metrics))
    if PREFILL_REPORTS.get((namespace, name)) != report:
        PREFILL_REPORTS[(namespace, name)] = report
        refresh_status(kube, namespace, name)


def window_status(state: AutoscalerState, window: float, now: float) -> ScaleDownWindow | None:
    if state.since is None:
        return None
    levels = window_levels(state.history, window, now)
    return ScaleDownWindow(since=_rfc3339_up(state.since),
                           levels=[RecommendationLevel(replicas=r, until=None if t is None else _rfc3339_up(t)) for r, t in levels])


def _rfc3339_up(t: float) -> str:
    """Rounded up to the second: a resumed window never ends earlier than the one it continues."""
    return datetime.fromtimestamp(math.ceil(t), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _unix(stamp: str | None) -> float | None:
    return None if stamp is None else datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _maybe_scale_to_zero(source: PrometheusSource, spec: InferenceServiceSpec, name: str, namespace: str, state: AutoscalerState,
                         decision: Decision, current: int, now: float) -> None:
    """At one pod that the engine metrics would keep, and idle for the whole window: to zero."""
    try:
        activity = source.gateway_activity(served_name(spec, name))
        busy = source.engines_busy(spec.engine, namespace, name)
    except MetricsUnavailable as e:
        activity, busy = None, None
        log.info("%s/%s: not scaling to zero: %s", namespace, name, e)
    why_not = observe_idle(state.idle, now, activity, busy, policy_of(spec).stale_after)
    if current != 1 or decision.desired != 1:
        return
    window = spec.autoscaling.scale_to_zero_idle_seconds
    if why_not is not None:
        decision.reason += f"; not idle: {why_not}"
    elif now - state.idle.since < window:
        # the start of the idle time, not its length: a reason that changes every pass would be a status write every pass
        decision.reason += f"; idle since {_rfc3339_up(state.idle.since)}, scaling to zero {window}s after"
    else:
        decision.desired, decision.reason = 0, f"scale down 1 -> 0: no request for {now - state.idle.since:.0f}s (scaleToZeroIdleSeconds {window})"
        decision.active_reason = "ScaledToZero"


def wake_requested(meta: dict, status: dict) -> str | None:
    """The gateway's wake-up request (the annotation's time), if it came after the service last scaled (to zero)."""
    requested = (meta.get("annotations") or {}).get(WAKE_ANNOTATION)
    if not requested:
        return None
    try:
        asked = datetime.fromisoformat(requested.replace("Z", "+00:00"))
    except ValueError:
        log.warning("%s/%s: ignoring annotation %s=%r: not an RFC 3339 time", meta.get("namespace"), meta.get("name"), WAKE_ANNOTATION, requested)
        return None
    last = status.get("lastScaleTime")
    # lastScaleTime has whole seconds: a request within the second of the scale-down wakes it (never lost).
    if last and asked < datetime.fromisoformat(last.replace("Z", "+00:00")):
        return None
    return requested


METRICS_PROBLEMS = ("MetricsUnavailable", "MetricsStale", "MetricsMissing")


def _actuate(kube: Kube, body: dict, decision: Decision, current: int, spec: InferenceServiceSpec, window: ScaleDownWindow | None = None) -> None:
    meta = body["metadata"]
    labels = (meta["namespace"], meta["name"])
    metrics.METRICS_AVAILABLE.labels(*labels).set(0 if decision.active_reason in METRICS_PROBLEMS else 1)
    metrics.DESIRED.labels(*labels).set(decision.desired)
    if decision.desired != current:
        metrics.SCALINGS.labels(*labels, "up" if decision.desired > current else "down").inc()
        kube.scale_isvc(meta["name"], meta["namespace"], decision.desired)
        kind = "ScaledUp" if decision.desired > current else "ScaledDown"
        kube.event(body, "Normal", kind, decision.reason)
        log.info("%s/%s: %s", meta["namespace"], meta["name"], decision.reason)
    _report(kube, body, decision, spec, current=current, window=window)


def _report(kube: Kube, body: dict, decision: Decision | None, spec: InferenceServiceSpec, current: int | None = None,
            note: tuple[str, str, str] | None = None, window: ScaleDownWindow | None = None) -> None:
    """Hand the autoscaler's part of status to the status writer (reconcile.write_status), which writes
    it when it changed. The autoscaler itself writes only the scale subresource."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    gen = meta.get("generation")
    previous = REPORTS.get(key)
    if decision is None:
        report = AutoscalerReport(note, gen)
    else:
        stamp = now_rfc3339()
        report = AutoscalerReport(("True" if decision.scaling_active else "False", decision.active_reason, decision.reason), gen,
                                  MetricsSnapshot(kv_cache_utilization=f"{decision.mean_kv:.2f}" if decision.mean_kv is not None else None,
                                                  queue_depth=f"{decision.mean_queue:.2f}" if decision.mean_queue is not None else None,
                                                  pods=decision.pods_with_metrics, time=stamp),
                                  previous.scaling_history if previous else None, previous.last_scale_time if previous else None, window)
        if current is not None and decision.desired != current:
            history = report.scaling_history
            if history is None:  # the first scaling of this process: continue the history status holds
                history = [ScalingEvent.model_validate(h) for h in (body.get("status") or {}).get("scalingHistory", [])]
            report.scaling_history = (history + [ScalingEvent(time=stamp, from_replicas=current, to_replicas=decision.desired,
                                                              reason=decision.reason)])[-HISTORY_LENGTH:]
            report.last_scale_time = stamp
    REPORTS[key] = report
    if previous is not None and previous.written and report.same_as(previous):
        report.written = True  # nothing new to write
        return
    refresh_status(kube, *key)
    report.written = True
