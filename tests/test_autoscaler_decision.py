"""The scaling decision over scripted metric timelines (tables) and random ones (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.operator.autoscaler.decision import Decision, PodSample, Policy, Recommendation, decide, max_step_up

POLICY = Policy(min_replicas=1, max_replicas=10, target_kv_cache_utilization=0.7, target_queue_depth=4, tolerance=0.1,
                scale_down_window=300, stale_after=45)


def pods(n):
    return [f"p{i}" for i in range(n)]


def samples(n, kv, queue, t):
    return [PodSample(f"p{i}", kv, queue, t) for i in range(n)]


class Loop:
    """Replays a timeline through decide(), carrying history and replicas like the operator does."""

    def __init__(self, replicas=1, policy=POLICY):
        self.replicas, self.policy, self.history, self.changes = replicas, policy, [], []

    def step(self, t, kv, queue, starting=0, ready=None, error=None, sample_time=None) -> Decision:
        ready = self.replicas - starting if ready is None else ready
        d = decide(t, self.replicas, pods(ready), starting, samples(ready, kv, queue, t if sample_time is None else sample_time),
                   self.policy, self.history, error)
        self.history = d.history
        if d.desired != self.replicas:
            self.changes.append((t, self.replicas, d.desired))
            self.replicas = d.desired
        return d


def test_steady_load_holds():
    loop = Loop(replicas=3)
    for t in range(0, 900, 15):
        loop.step(t, kv=0.7, queue=4.0)
    assert loop.changes == [] and loop.replicas == 3


def test_noise_within_tolerance_does_not_flap():
    loop = Loop(replicas=3)
    for i, t in enumerate(range(0, 900, 15)):
        wiggle = 0.06 if i % 2 else -0.06
        loop.step(t, kv=0.7 * (1 + wiggle), queue=4.0 * (1 - wiggle))
    assert loop.changes == []


def test_burst_scales_up_within_one_interval_bounded():
    loop = Loop(replicas=2)
    d = loop.step(0, kv=0.95, queue=40.0)  # wants ceil(2 * 10) = 20
    assert d.desired == 6 and "scale up 2 -> 6" in d.reason and "wants 20" in d.reason  # max(+4, x2) = 6
    assert d.scaling_active and d.active_reason == "ValidMetrics"
    loop2 = Loop(replicas=8)
    assert loop2.step(0, kv=0.9, queue=40.0).desired == 10  # x2 = 16, clamped to max 10


def test_starting_pods_are_counted():
    loop = Loop(replicas=1)
    assert loop.step(0, kv=0.9, queue=12.0).desired == 3
    d = loop.step(15, kv=0.95, queue=20.0, starting=2)  # 1 ready + 2 starting: the queue grows on the one ready pod
    assert d.desired == 3 and "still starting" in d.reason
    d = loop.step(30, kv=0.95, queue=7.0, starting=0)  # now 3 serve: ratio judged on them
    assert d.desired == 6


def test_scale_down_waits_for_the_window_and_takes_its_highest():
    loop = Loop(replicas=6)
    loop.step(0, kv=0.7, queue=4.0)
    for t in range(15, 300, 15):
        d = loop.step(t, kv=0.1, queue=0.0 if t != 150 else 2.0)  # one blip wants 3 at t=150
        assert d.desired == 6, (t, d.reason)
    d = loop.step(300, kv=0.1, queue=0.0)
    assert d.desired == 6  # the t=0 recommendation (6) is still inside the window
    d = loop.step(315, kv=0.1, queue=0.0)
    assert d.desired == 3 and "highest recommendation" in d.reason  # the blip at t=150 is the window's highest
    for t in range(330, 465, 15):
        loop.step(t, kv=0.1, queue=0.0)
    assert loop.replicas == 3
    loop.step(465, kv=0.1, queue=0.0)
    assert loop.replicas == 1


def test_stale_or_missing_metrics_never_scale_down():
    loop = Loop(replicas=4)
    loop.history = [Recommendation(t, 1) for t in range(-400, 0, 15)]
    d = loop.step(0, kv=0.0, queue=0.0, sample_time=-100)  # stale
    assert d.desired == 4 and not d.scaling_active and d.active_reason == "MetricsStale"
    d = decide(0, 4, pods(4), 0, [], POLICY, loop.history)  # missing
    assert d.desired == 4 and d.active_reason == "MetricsMissing"
    d = decide(0, 4, pods(4), 0, samples(2, 0.0, 0.0, 0), POLICY, loop.history)  # partial: two pods silent
    assert d.desired == 4 and d.active_reason == "PartialMetrics"
    d = loop.step(0, kv=0.0, queue=0.0, error="connection refused")  # Prometheus down
    assert d.desired == 4 and not d.scaling_active and d.active_reason == "MetricsUnavailable" and "connection refused" in d.reason


def test_partial_metrics_may_still_scale_up():
    d = decide(0, 2, pods(2), 0, samples(1, 0.99, 30.0, 0), POLICY, [])
    assert d.desired > 2 and d.active_reason == "PartialMetrics"


def test_min_max_respected_and_no_ready_pod_holds():
    d = decide(0, 1, pods(1), 0, samples(1, 0.0, 0.0, 0), Policy(2, 5, 0.7, 4), [])
    assert d.desired == 2  # below min: clamped up at once
    d = decide(0, 9, pods(9), 0, samples(9, 0.7, 4.0, 0), Policy(1, 5, 0.7, 4), [])
    assert d.desired == 5
    d = decide(0, 2, [], 2, [], POLICY, [])
    assert d.desired == 2 and d.active_reason == "NoReadyPods" and not d.scaling_active


def test_kv_signal_alone_drives_scaling():
    d = decide(0, 2, pods(2), 0, samples(2, 1.0, 0.0, 0), POLICY, [])
    assert d.desired == 3  # ceil(2 * 1.0 / 0.7)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 50), st.integers(0, 3), st.booleans()), min_size=1, max_size=60),
       st.integers(1, 4), st.integers(4, 12))
def test_random_timelines_keep_invariants(timeline, lo, hi):
    policy = Policy(lo, hi, 0.7, 4, 0.1, 120, 45)
    loop = Loop(replicas=lo, policy=policy)
    for i, (kv, queue, starting, metrics_ok) in enumerate(timeline):
        t = i * 15.0
        before = loop.replicas
        starting = min(starting, before)
        ready = before - starting
        d = decide(t, before, pods(ready), starting, samples(ready, kv, queue, t) if metrics_ok else [], policy, loop.history)
        loop.history = d.history
        assert lo <= d.desired <= hi
        if d.desired > before:
            assert d.desired <= max_step_up(before) and starting == 0 and ready > 0
        if d.desired < before:
            assert metrics_ok and ready > 0 and d.scaling_active
            assert any(r.time <= t - policy.scale_down_window for r in d.history)  # a whole window was seen
            assert all(r.replicas <= d.desired for r in d.history if r.time > t - policy.scale_down_window)
        loop.replicas = d.desired


# --- hardening (issue #11): bad numbers never move replicas ----------------------------------------

import math  # noqa: E402

import pytest  # noqa: E402


@pytest.mark.parametrize("kv,queue,stamp", [(math.nan, 1.0, 0), (0.5, math.inf, 0), (-0.5, 1.0, 0), (0.5, -3.0, 0), (0.5, 1.0, 3600)])
def test_nan_inf_negative_or_future_samples_hold_as_metrics_unavailable(kv, queue, stamp):
    history = [Recommendation(t, 1) for t in range(0, 1000, 15)]
    d = decide(1000, 3, pods(3), 0, [PodSample(p, kv, queue, 1000 + stamp) for p in pods(3)], POLICY, history)
    assert d.desired == 3 and d.active_reason == "MetricsUnavailable" and not d.scaling_active


def test_failed_and_deleted_pods_are_not_starting_capacity():
    from kvpilot.operator.autoscaler.loop import live_pods

    def pod(name, phase="Running", deleting=False):
        meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
        return {"metadata": meta, "status": {"phase": phase}}

    live = live_pods([pod("a"), pod("evicted", "Failed"), pod("done", "Succeeded"), pod("gone", deleting=True), pod("new", "Pending")])
    assert [p["metadata"]["name"] for p in live] == ["a", "new"]


def test_idle_tracker_counts_only_fresh_quiet_gateway_metrics():
    """Scale to zero's evidence: present, fresh gateway metrics with nothing in flight, nothing held,
    an unchanged request counter and idle engines. Anything else restarts the idle window."""
    from kvpilot.operator.autoscaler.decision import IdleTracker, observe_idle
    from kvpilot.operator.autoscaler.promql import GatewayActivity

    t = IdleTracker()
    quiet = GatewayActivity(requests=7, active=0, timestamp=1000)
    assert observe_idle(t, 1000, quiet, 0, stale_after=45) is None and t.since == 1000
    assert observe_idle(t, 1030, GatewayActivity(7, 0, 1029), 0, 45) is None and t.since == 1000  # still idle since 1000
    assert observe_idle(t, 1040, GatewayActivity(8, 0, 1039), 0, 45) == "new requests through the gateway" and t.since is None
    assert observe_idle(t, 1050, GatewayActivity(8, 0, 1049), 0, 45) is None and t.since == 1050
    for activity, busy, why in [(None, 0, "no gateway reports"), (GatewayActivity(8, 0, 1000), 0, "stale (60s old)"),
                                (GatewayActivity(8, 1, 1059), 0, "1 request(s) in flight or held"),
                                (GatewayActivity(8, 0, 1059), None, "engines' request metrics are missing"),
                                (GatewayActivity(8, 0, 1059), 2, "2 request(s) running or waiting in the engines")]:
        t = IdleTracker(since=900, requests=8)
        assert why in observe_idle(t, 1060, activity, busy, 45) and t.since is None


def test_wake_request_counts_only_after_the_last_scale():
    from kvpilot.operator.autoscaler.loop import wake_requested
    from kvpilot.operator.crd_types import WAKE_ANNOTATION

    def meta(stamp):
        return {"name": "m", "namespace": "n", "annotations": {WAKE_ANNOTATION: stamp} if stamp else {}}

    assert wake_requested(meta(None), {}) is None
    assert wake_requested(meta("2026-11-22T10:00:00.5Z"), {}) == "2026-11-22T10:00:00.5Z"  # created at zero: any request wakes
    assert wake_requested(meta("2026-11-22T10:00:00.5Z"), {"lastScaleTime": "2026-11-22T10:00:00Z"}) is not None  # same second: woken
    assert wake_requested(meta("2026-11-22T09:59:59.9Z"), {"lastScaleTime": "2026-11-22T10:00:00Z"}) is None  # before the scale to zero
    assert wake_requested(meta("yesterday"), {}) is None


@settings(max_examples=200, deadline=None)
@given(loads=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 30)), min_size=2, max_size=40), cut=st.integers(0, 39),
       start=st.integers(1, 8))
def test_a_window_resumed_from_its_levels_decides_as_the_uninterrupted_one(loads, cut, start):
    """A new leader rebuilds the history from status.scaleDownWindow (when recommendations began, and
    window_levels, written only when they change): it makes the decisions the old leader would have
    made, until, at most, one scale-down comes later (the latest recommendation resumes as standing
    now, and times are rounded up to the second) — a resumed window never scales down earlier or further."""
    from kvpilot.operator.autoscaler.decision import history_from_levels, window_levels

    policy = Policy(min_replicas=1, max_replicas=10, target_kv_cache_utilization=0.7, target_queue_depth=4, tolerance=0.1,
                    scale_down_window=60, stale_after=45)
    straight, resumed = Loop(replicas=start, policy=policy), Loop(replicas=start, policy=policy)
    written, since = [], None
    cut %= len(loads)
    for i, (kv, queue) in enumerate(loads):
        t = 15.0 * i
        current = straight.replicas
        if i == cut:  # the leader changes before this step: only the last levels written survive
            levels = written[-1] if written else []
            resumed.history = history_from_levels(None if since is None else float(math.ceil(since)),
                                                  [(r, None if u is None else float(math.ceil(u))) for r, u in levels], t)
        a, b = straight.step(t, kv=kv, queue=queue), resumed.step(t, kv=kv, queue=queue)
        if a.desired != b.desired:
            assert i >= cut and a.desired < current and current >= b.desired > a.desired, (i, cut, a.reason, b.reason)
            return  # from here on they run at different sizes
        if since is None and straight.history:
            since = straight.history[0].time
        levels = window_levels(straight.history, policy.scale_down_window, t)
        if not written or written[-1] != levels:
            written.append(levels)


def test_window_levels_change_only_with_a_new_size_of_recommendation():
    from kvpilot.operator.autoscaler.decision import window_levels

    history = [Recommendation(0, 4), Recommendation(15, 4), Recommendation(30, 2), Recommendation(45, 2), Recommendation(60, 3)]
    assert window_levels(history[:2], 300, 15) == [(4, None)]
    assert window_levels(history[:2], 300, 15) == window_levels(history[:1], 300, 0)  # time passing writes nothing
    assert window_levels(history[:4], 300, 45) == [(4, 15), (2, None)] == window_levels(history[:3], 300, 30)
    assert window_levels(history, 300, 60) == [(4, 15), (3, None)]  # 2 is outdone by the later 3
    assert window_levels(history, 40, 60) == [(3, None)]  # 4 has left the window
