"""The PromQL client against a real Prometheus scraping static fake exporters with known values:
per-pod samples, an absent pod, a stale series, each engine's metric names, a prefill pool's pods apart."""

from __future__ import annotations

import time

import pytest

from e2e.conftest import start_prometheus
from e2e.fake_exporter import Exporter
from kvpilot.operator.autoscaler.promql import MetricsUnavailable, PrometheusSource


@pytest.fixture
def exporters():
    made = []

    def make(body):
        e = Exporter(body)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_samples_absent_and_stale(prometheus_factory, exporters):
    a = exporters('kvpilot:kv_cache_usage_perc{model_name="m"} 0.25\nkvpilot:num_requests_waiting{model_name="m"} 3\n')
    b = exporters('kvpilot:kv_cache_usage_perc{model_name="m"} 0.75\nkvpilot:num_requests_waiting{model_name="m"} 0\n')
    v = exporters('vllm:gpu_cache_usage_perc{model_name="x"} 0.5\nvllm:num_requests_waiting{model_name="x"} 7\n')
    s = exporters('sglang:token_usage 0.1\nsglang:num_queue_reqs 2\n')
    p = exporters('kvpilot:kv_cache_usage_perc{model_name="m"} 0.5\nkvpilot:num_requests_waiting{model_name="m"} 9\n')
    prom = prometheus_factory("1s")
    for pod, e in (("pod-a", a), ("pod-b", b)):
        prom.add_static(f"kv-{pod}", [f"127.0.0.1:{e.port}"], {"namespace": "ns1", "inferenceservice": "svc", "pod": pod})
    # a prefill pool's pod of the same service (disaggregation): counted apart
    prom.add_static("kv-pod-p", [f"127.0.0.1:{p.port}"], {"namespace": "ns1", "inferenceservice": "svc", "pod": "pod-p", "role": "prefill"})
    prom.add_static("vllm", [f"127.0.0.1:{v.port}"], {"namespace": "ns1", "inferenceservice": "old-vllm", "pod": "pod-v"})
    prom.add_static("sglang", [f"127.0.0.1:{s.port}"], {"namespace": "ns1", "inferenceservice": "sg", "pod": "pod-s"})
    start_prometheus(prom)
    src = PrometheusSource(prom.url)
    prom.wait_for('kvpilot:num_requests_waiting{inferenceservice="svc"}', lambda r: len(r) == 3)
    samples = {x.pod: x for x in src.pod_samples("kvpilot", "ns1", "svc")}
    assert set(samples) == {"pod-a", "pod-b"}
    (ps,) = src.pod_samples("kvpilot", "ns1", "svc", prefill=True)
    assert (ps.pod, ps.kv_cache_utilization, ps.queue_depth) == ("pod-p", 0.5, 9.0)
    assert (samples["pod-a"].kv_cache_utilization, samples["pod-a"].queue_depth) == (0.25, 3.0)
    assert (samples["pod-b"].kv_cache_utilization, samples["pod-b"].queue_depth) == (0.75, 0.0)
    assert all(abs(time.time() - x.timestamp) < 5 for x in samples.values())
    assert src.pod_samples("kvpilot", "ns1", "absent") == []  # an absent service: no samples, not an error
    assert src.pod_samples("kvpilot", "ns2", "svc") == []     # namespaces are kept apart
    prom.wait_for('vllm:gpu_cache_usage_perc', lambda r: len(r) == 1)
    (vs,) = src.pod_samples("vllm", "ns1", "old-vllm")       # the older vLLM metric name still works
    assert (vs.kv_cache_utilization, vs.queue_depth) == (0.5, 7.0)
    prom.wait_for('sglang:token_usage', lambda r: len(r) == 1)
    (ss,) = src.pod_samples("sglang", "ns1", "sg")
    assert (ss.kv_cache_utilization, ss.queue_depth) == (0.1, 2.0)

    # a target that starts failing: its series goes stale in Prometheus and drops out of the samples
    b.body = None
    prom.wait_for('kvpilot:num_requests_waiting{inferenceservice="svc",role!="prefill"}', lambda r: len(r) == 1, timeout=20)
    assert {x.pod for x in src.pod_samples("kvpilot", "ns1", "svc")} == {"pod-a"}

    prom.stop()
    with pytest.raises(MetricsUnavailable, match="unreachable"):
        src.pod_samples("kvpilot", "ns1", "svc")


def test_old_sample_timestamps_are_reported(prometheus_factory, exporters):
    """A sample carries its own (old) timestamp: the decision's staleness check sees its age."""
    old_ms = int((time.time() - 120) * 1000)
    e = exporters(f'kvpilot:kv_cache_usage_perc 0.5 {old_ms}\nkvpilot:num_requests_waiting 1 {old_ms}\n')
    prom = prometheus_factory("1s").add_static("old", [f"127.0.0.1:{e.port}"], {"namespace": "n", "inferenceservice": "s", "pod": "p"})
    start_prometheus(prom)
    src = PrometheusSource(prom.url)
    deadline = time.monotonic() + 20
    samples = []
    while time.monotonic() < deadline and not samples:
        samples = src.pod_samples("kvpilot", "n", "s")
        time.sleep(0.5)
    (s,) = samples
    assert 100 < time.time() - s.timestamp < 200
