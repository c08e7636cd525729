"""The scaling decision: a pure function of what was observed (docs/gateway-and-autoscaling.md, docs/observability.md).

per signal s with target t: desired_s = ceil(ready x mean_s / t); desired = max over signals;
no change while every ratio is within the tolerance. Up at once, at most max(+4, x2) per step;
while pods are still starting, no further scale-up (a cold start is not answered with more pods). Down only to the highest recommendation of the stabilization
window, and only once a whole window has been observed. Missing or stale metrics never scale down.
No ready pod: hold. Always clamped to [min, max].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CLOCK_SKEW_SECONDS = 60.0  # a sample stamped further in the future than this is not believed


@dataclass(frozen=True, slots=True)
class PodSample:
    pod: str
    kv_cache_utilization: float | None   # 0-1
    queue_depth: float | None            # waiting requests
    timestamp: float                     # unix seconds of the newest sample


@dataclass(frozen=True, slots=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target_kv_cache_utilization: float
    target_queue_depth: float
    tolerance: float = 0.1
    scale_down_window: float = 300.0
    stale_after: float = 45.0


@dataclass(frozen=True, slots=True)
class Recommendation:
    time: float
    replicas: int


@dataclass(slots=True)
class Decision:
    desired: int
    reason: str
    scaling_active: bool
    active_reason: str
    history: list[Recommendation] = field(default_factory=list)
    mean_kv: float | None = None
    mean_queue: float | None = None
    pods_with_metrics: int = 0

    def changed(self, current: int) -> bool:
        return self.desired != current


def _clamp(n: int, policy: Policy) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, n))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def max_step_up(current: int) -> int:
    return max(current + 4, current * 2)


def decide(now: float, current: int, ready_pods: list[str], starting: int, samples: list[PodSample], policy: Policy,
           history: list[Recommendation], metrics_error: str | None = None) -> Decision:
    """current: replicas asked for now (spec.replicas); ready_pods: pods Ready; starting: pods that
    exist but are not ready yet; samples: per-pod metrics; history: earlier recommendations."""
    clamped = _clamp(current, policy)
    keep = [r for r in history if r.time >= now - policy.scale_down_window]
    older = [r for r in history if r.time < now - policy.scale_down_window]
    if older:
        keep.insert(0, older[-1])  # proves that a whole window has been observed

    def hold(reason: str, active_reason: str, active: bool = False, **kw) -> Decision:
        why = reason if clamped == current else f"{reason}; clamped {current} -> {clamped} to [{policy.min_replicas}, {policy.max_replicas}]"
        return Decision(clamped, why, active, active_reason, keep, **kw)

    if not metrics_error:  # a source that let a bad number through still never moves replicas
        bad = [s.pod for s in samples if not math.isfinite(s.timestamp) or s.timestamp > now + CLOCK_SKEW_SECONDS or any(
            v is not None and not (math.isfinite(v) and v >= 0) for v in (s.kv_cache_utilization, s.queue_depth))]
        if bad:
            metrics_error = f"invalid (negative, non-finite or future-dated) samples from {', '.join(bad)}"
    if metrics_error:
        return hold(f"holding at {current}: metrics unavailable ({metrics_error})", "MetricsUnavailable")
    if not ready_pods:
        return hold(f"holding at {current}: no pod is ready ({starting} starting)", "NoReadyPods")

    ready = set(ready_pods)
    fresh = {s.pod: s for s in samples if s.pod in ready and now - s.timestamp <= policy.stale_after}
    stale = sorted(s.pod for s in samples if s.pod in ready and s.pod not in fresh)
    missing = sorted(ready - fresh.keys() - set(stale))
    if not fresh:
        what = f"stale for {', '.join(stale)}" if stale else f"missing for {', '.join(missing)}"
        return hold(f"holding at {current}: metrics {what}", "MetricsStale" if stale else "MetricsMissing")

    kv = _mean([s.kv_cache_utilization for s in fresh.values() if s.kv_cache_utilization is not None])
    queue = _mean([s.queue_depth for s in fresh.values() if s.queue_depth is not None])
    n = len(ready)
    ratios = {}
    if kv is not None:
        ratios["kv"] = kv / policy.target_kv_cache_utilization
    if queue is not None:
        ratios["queue"] = queue / policy.target_queue_depth
    numbers = dict(mean_kv=kv, mean_queue=queue, pods_with_metrics=len(fresh))
    observed = (f"kv {kv:.2f}/{policy.target_kv_cache_utilization:g}" if kv is not None else "kv n/a") + ", " + \
               (f"queue {queue:.2f}/{policy.target_queue_depth:g}" if queue is not None else "queue n/a") + f" over {n} ready"
    if not ratios:
        return hold(f"holding at {current}: pods report neither signal", "MetricsMissing", **numbers)

    if all(abs(r - 1.0) <= policy.tolerance for r in ratios.values()):
        raw = current
    else:
        raw = max(math.ceil(n * r - 1e-9) for r in ratios.values())
    recommendation = _clamp(raw, policy)
    keep.append(Recommendation(now, recommendation))
    partial = stale or missing
    active_reason = "PartialMetrics" if partial else "ValidMetrics"

    if recommendation > clamped:  # up: at once, bounded
        if starting:  # capacity is on its way: judge again once it serves, not answer a cold start with more pods
            return Decision(clamped, f"holding at {current}: {observed} wants {raw}, but {starting} pod(s) are still starting",
                            not partial, active_reason, keep, **numbers)
        target = min(recommendation, max_step_up(clamped), policy.max_replicas)
        return Decision(target, f"scale up {current} -> {target}: {observed} (wants {raw})", not partial, active_reason, keep, **numbers)
    if recommendation < clamped:
        if partial:
            return hold(f"holding at {current}: not scaling down with metrics missing for {', '.join(partial)}", "PartialMetrics", **numbers)
        window_observed = keep[0].time <= now - policy.scale_down_window
        highest = max(r.replicas for r in keep if r.time >= now - policy.scale_down_window)
        if not window_observed:
            return Decision(clamped, f"holding at {current}: {observed} wants {recommendation}, waiting for a full "
                                     f"{policy.scale_down_window:g}s window", True, active_reason, keep, **numbers)
        if highest < clamped:
            return Decision(highest, f"scale down {current} -> {highest}: highest recommendation of the last "
                                     f"{policy.scale_down_window:g}s; {observed}", True, active_reason, keep, **numbers)
        return Decision(clamped, f"holding at {current}: {observed}; recommendation {highest} within the window", True, active_reason, keep, **numbers)
    return Decision(clamped, f"holding at {current}: {observed}" if clamped == current else
                    f"clamped {current} -> {clamped} to [{policy.min_replicas}, {policy.max_replicas}]", not partial, active_reason, keep, **numbers)


# --- the window across a leader change ------------------------------------------------------------

def window_levels(history: list[Recommendation], window: float, now: float) -> list[tuple[int, float | None]]:
    """What of a recommendation history the scale-down still depends on: the recommendations inside the
    window not outdone by a later one (oldest, highest first), the latest as (replicas, None) — still
    standing. It changes only when a recommendation of another size comes or an old one leaves the
    window, not as time passes: persisted, it is rarely written. (Whether a whole window has been
    observed is the time of the first recommendation, which never changes.)"""
    levels: list[tuple[int, float]] = []
    for r in history:
        while levels and levels[-1][0] <= r.replicas:
            levels.pop()
        levels.append((r.replicas, r.time))
    levels = [lv for lv in levels if lv[1] > now - window] or levels[-1:]  # older ones no longer bound the window
    return [(replicas, t) for replicas, t in levels[:-1]] + [(levels[-1][0], None)] if levels else []


def history_from_levels(since: float | None, levels: list[tuple[int, float | None]], now: float) -> list[Recommendation]:
    """A history that decide() treats as the one `levels` came from: a recommendation of nothing when
    recommendations began (`since`: the window counts as observed once that is a window old), then each
    level recommended last at its time, the standing one now."""
    history = [Recommendation(since, 0)] if since is not None else []
    return history + [Recommendation(now if t is None else t, replicas) for replicas, t in levels]


# --- scale to zero ---------------------------------------------------------------------------------

@dataclass(slots=True)
class IdleTracker:
    """Since when a service with minReplicas 0 has been seen idle (in memory: an operator restart
    starts the idle window again, which only ever delays a scale to zero)."""

    since: float | None = None       # first evaluation that saw no traffic, after the last that did
    requests: float | None = None    # the gateways' request counter (summed) seen then


def observe_idle(tracker: IdleTracker, now: float, activity, engines_busy: float | None, stale_after: float) -> str | None:
    """Update `tracker` with one observation; returns why the service is not (known to be) idle, None when it is.

    activity: a promql.GatewayActivity, or None when no gateway reports the model; engines_busy: requests
    running or waiting in its engines (None: unknown). Only present, fresh gateway metrics that show no
    request in flight, none held and an unchanged request counter count as idle; anything missing,
    stale or moving restarts the window."""
    if activity is None:
        why = "no gateway reports its request metrics"
    elif now - activity.timestamp > stale_after:
        why = f"the gateway's request metrics are stale ({now - activity.timestamp:.0f}s old)"
    elif activity.active > 0:
        why = f"{activity.active:g} request(s) in flight or held at the gateway"
    elif engines_busy is None:
        why = "the engines' request metrics are missing"
    elif engines_busy > 0:
        why = f"{engines_busy:g} request(s) running or waiting in the engines"
    elif tracker.requests is not None and activity.requests != tracker.requests:
        why = "new requests through the gateway"
    else:
        why = None
    if why is not None:
        tracker.since = None
        tracker.requests = activity.requests if activity is not None else None
        return why
    if tracker.since is None:
        tracker.since, tracker.requests = now, activity.requests
    return None
