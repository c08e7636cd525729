"""Scale to and from zero end to end (#18): an InferenceService with minReplicas 0 starts with no pod
(Ready, reason ScaledToZero, shown by `kubectl get kvis`); requests through kvpilot-gateway are held
while the gateway asks for a pod (annotation) and the operator's autoscaler scales to 1, then served —
including those arriving while the pod starts; with no traffic for scaleToZeroIdleSeconds (the
gateway's request metrics read from the real Prometheus) it goes back to zero, and wakes again.
Meanwhile every panel query of the chart's Grafana dashboard is evaluated against that Prometheus."""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from e2e.cluster import TOKEN
from e2e.conftest import start_prometheus
from e2e.gateway_proc import GatewayProcess
from e2e.isvc import apply_isvc, condition, get_isvc
from e2e.net import free_port
from e2e.operator_proc import OperatorProcess
from e2e.pod_runner import PodRunner
from e2e.prometheus import dashboard_queries
from e2e.waiting import wait_until
from kvpilot.operator.crd_types import WAKE_ANNOTATION

pytestmark = pytest.mark.cluster
IDLE_SECONDS = 8
SPEC = {"model": {"source": "smollm2-135m"}, "resources": {"cpuOnly": True}, "minReplicas": 0, "maxReplicas": 2,
        "engineSettings": {"kvCacheMemory": "32MiB", "maxModelLen": 512},
        "autoscaling": {"intervalSeconds": 1, "scaleToZeroIdleSeconds": IDLE_SECONDS, "metricsStaleAfterSeconds": 5,
                        "scaleDownStabilizationSeconds": 5}}


def send(gateway: str, results: list, i: int) -> None:
    t = time.monotonic()
    try:
        r = httpx.post(f"{gateway}/v1/completions", timeout=180,
                       json={"model": "sleepy", "prompt": f"Request {i}: count to three.", "max_tokens": 4, "temperature": 0})
        results.append((i, r.status_code, time.monotonic() - t, r.text[:200]))
    except httpx.HTTPError as e:
        results.append((i, type(e).__name__, time.monotonic() - t, str(e)))


def send_all(gateway: str, n: int, spacing: float) -> list:
    """n requests, one every `spacing` seconds, each on its own thread; waits for all."""
    results, threads = [], []
    for i in range(n):
        threads.append(threading.Thread(target=send, args=(gateway, results, i)))
        threads[-1].start()
        time.sleep(spacing)
    for t in threads:
        t.join(200)
    return sorted(results)


@pytest.mark.timeout(360)
def test_scale_from_zero_and_back(cluster, namespace, prometheus_factory, tmp_path):
    cluster.kubectl("apply", "-f", str(Path(__file__).resolve().parents[1] / "crds"))
    runner = PodRunner(cluster.server, tmp_path / "pods").start()
    gateway = GatewayProcess(cluster.kubeconfig, namespace, tmp_path / "gateway.log")
    operator_port = free_port()
    prom = prometheus_factory("1s").add_kubernetes_pods(cluster.server, TOKEN, str(cluster.state_dir / "certs" / "apiserver.crt"))
    start_prometheus(prom.add_static("kvpilot-gateway", [f"127.0.0.1:{gateway.port}"]).add_static("kvpilot-operator", [f"127.0.0.1:{operator_port}"]))
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log",
                         args=["--prometheus-url", prom.url, "--liveness", f"127.0.0.1:{operator_port}"])
    try:
        apply_isvc(cluster, namespace, "sleepy", SPEC)

        def isvc() -> dict:
            return get_isvc(cluster, namespace, "sleepy") or {}

        wait_until(lambda: condition(isvc(), "Ready").get("reason") == "ScaledToZero", timeout=60, what="Ready/ScaledToZero at 0 pods")
        assert condition(isvc(), "Ready")["status"] == "True" and isvc()["status"]["replicas"] == 0
        assert "ScaledToZero" in cluster.kubectl("get", "kvis", "-n", namespace).stdout
        wait_until(lambda: prom.query('kvpilot_gateway_held_requests{model="sleepy"}'), timeout=30, what="the gateway's metrics in Prometheus")

        # 6 requests, one every 2 s: the first ones are held through the cold start, later ones arrive while it scales up.
        t0 = time.monotonic()
        results = send_all(gateway.url, 6, spacing=2.0)
        t_last = time.monotonic()  # the last response: the idle window runs from here (the checks below take seconds)
        assert [r[1] for r in results] == [200] * 6, results
        first = results[0][2]
        assert WAKE_ANNOTATION in isvc()["metadata"]["annotations"]
        woke = [h for h in isvc()["status"]["scalingHistory"] if h["from"] == 0]
        assert woke and woke[0]["to"] == 1 and "waiting at the gateway" in woke[0]["reason"]
        served = [r for r in results if r[2] < 2.0]  # the pod was Ready by then
        print(f"scale from zero: first request held and answered in {first:.1f}s; latency of the 6: "
              f"{', '.join(f'{r[2]:.1f}s' for r in results)}; median {statistics.median(r[2] for r in results):.1f}s")
        hold = prom.wait_for('kvpilot_gateway_hold_seconds_count{model="sleepy"}', timeout=10)
        assert float(hold[0]["value"][1]) >= 1  # held requests were counted as such
        # The chart's dashboard: every panel's query, as Grafana fills it in, returns data from this run.
        # A rate() has data from its series' second scrape on: the last responses' counters may be one scrape old.
        queries = dashboard_queries(namespace, "sleepy", "sleepy")
        deadline = time.monotonic() + 15
        while (empty := [title for title, expr in queries.items() if not prom.query(expr)]) and time.monotonic() < deadline:
            time.sleep(1)
        assert not empty, f"dashboard panels without data: {empty}"

        # Idle: back to zero after the window (the gateway's counter is present, fresh and still).
        # spec.replicas and the status's history are two writes: wait for both (a busy machine widens the gap)
        wait_until(lambda: isvc()["spec"].get("replicas") == 0 and isvc()["status"]["scalingHistory"][-1]["to"] == 0,
                   timeout=IDLE_SECONDS + 60, what="scaled back to zero")
        idle_for = time.monotonic() - t_last
        down = isvc()["status"]["scalingHistory"][-1]
        assert down["from"] == 1 and down["to"] == 0 and f"scaleToZeroIdleSeconds {IDLE_SECONDS}" in down["reason"]
        assert idle_for >= IDLE_SECONDS - 1
        wait_until(lambda: not runner_pods(cluster, namespace), timeout=60, what="the engine pod is gone")
        wait_until(lambda: condition(isvc(), "Ready").get("reason") == "ScaledToZero", timeout=30, what="Ready/ScaledToZero again")
        events = [e["message"] for e in json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]]
        assert any(m.startswith("scale down 1 -> 0") for m in events) and any(m.startswith("scale up 0 -> 1") for m in events), events

        # And wakes again (the wake-up must be newer than the scale to zero).
        again = send_all(gateway.url, 1, spacing=0)
        assert again[0][1] == 200, again
        print(f"second wake-up answered in {again[0][2]:.1f}s; back to zero {idle_for:.1f}s after the last request "
              f"(window {IDLE_SECONDS}s); whole run {time.monotonic() - t0:.0f}s; {len(served)} of 6 arrived after the pod was ready")
    finally:
        op.stop()
        gateway.stop()
        runner.stop()


def runner_pods(cluster, namespace: str) -> list[str]:
    out = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", "serving.kvpilot.dev/inferenceservice=sleepy", "-o", "json").stdout)
    return [p["metadata"]["name"] for p in out["items"]]
