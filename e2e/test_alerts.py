"""The chart's alert rules (#18): they pass `promtool check rules`, and each alert fires in a real
Prometheus when its condition is caused for real — the autoscaler pointed at a Prometheus that does
not answer (its metrics-available gauge drops to 0), an engine whose small KV cache is filled by
concurrent long requests, and an engine process killed (its scrape fails until the pod runner
restarts it). The rules come from `helm template` with short `for:` durations (values)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from e2e.cluster import TOKEN, _insecure, binaries
from e2e.conftest import start_prometheus
from e2e.isvc import apply_isvc, condition, get_isvc
from e2e.load import ready_endpoints
from e2e.net import free_port
from e2e.operator_proc import OperatorProcess
from e2e.pod_runner import PodRunner
from e2e.waiting import wait_until

pytestmark = pytest.mark.cluster
CHART = Path(__file__).resolve().parents[1] / "charts" / "kvpilot"
ALERTS = ("KvpilotEngineDown", "KvpilotKVCacheSaturated", "KvpilotAutoscalerMetricsMissing")


def chart_rules(cluster, path: Path, **values) -> Path:
    """The chart's PrometheusRule as a Prometheus rule file (values as JSON: --set would pass 0.5 as a string)."""
    sets = [a for k, v in {"prometheusRule.enabled": True, **values}.items() for a in ("--set-json", f"{k}={json.dumps(v)}")]
    docs = yaml.safe_load_all(cluster.helm("template", "kvpilot", str(CHART), *sets).stdout)
    rule = next(d for d in docs if d and d["kind"] == "PrometheusRule")
    path.write_text(json.dumps({"groups": rule["spec"]["groups"]}))
    return path


def test_chart_rules_pass_promtool(cluster, tmp_path):
    for name, values in (("default", {}), ("short", {"prometheusRule.engineDownFor": "1s", "prometheusRule.kvCacheSaturatedThreshold": 0.5})):
        path = chart_rules(cluster, tmp_path / f"{name}.rules.json", **values)
        r = subprocess.run([str(binaries()["promtool"]), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "SUCCESS: 3 rules found" in r.stdout, r.stdout + r.stderr
    assert [rule["alert"] for rule in json.loads(path.read_text())["groups"][0]["rules"]] == list(ALERTS)


def firing(prom, alert: str, namespace: str) -> dict | None:
    return next((a for a in prom.alerts() if a["labels"]["alertname"] == alert and a["state"] == "firing"
                 and a["labels"].get("namespace") == namespace), None)


@pytest.mark.timeout(300)
def test_each_alert_fires_when_its_condition_is_caused(cluster, namespace, prometheus_factory, tmp_path):
    cluster.kubectl("apply", "-f", str(CHART.parents[1] / "crds"))
    rules = chart_rules(cluster, tmp_path / "kvpilot.rules.json", **{"prometheusRule.engineDownFor": "1s", "prometheusRule.kvCacheSaturatedFor": "1s",
                                                                    "prometheusRule.autoscalerMetricsMissingFor": "1s",
                                                                    "prometheusRule.kvCacheSaturatedThreshold": 0.6})
    operator_port = free_port()
    prom = prometheus_factory("1s").add_kubernetes_pods(cluster.server, TOKEN, str(cluster.state_dir / "certs" / "apiserver.crt"))
    start_prometheus(prom.add_static("kvpilot-operator", [f"127.0.0.1:{operator_port}"]).add_rules(rules))
    runner = PodRunner(cluster.server, tmp_path / "pods").start()
    nowhere = f"http://127.0.0.1:{free_port()}"  # the autoscaler's Prometheus: nothing listens there
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", args=["--prometheus-url", nowhere, "--liveness", f"127.0.0.1:{operator_port}"])
    stop = threading.Event()
    try:
        # 8 MiB of fp32 KV cache = 11 blocks of 16 tokens; 4 sequences of up to 128 tokens want 32. Three
        # of them fit at first (9 blocks, 0.82), so the use swings around 0.8 as they grow and are
        # preempted (an alert at 0.8 for two evaluations in a row was flaky): the threshold here is 0.6.
        apply_isvc(cluster, namespace, "hot", {"model": {"source": "smollm2-135m"}, "resources": {"cpuOnly": True}, "minReplicas": 1, "maxReplicas": 1,
                                              "engineSettings": {"kvCacheMemory": "8MiB", "maxModelLen": 128, "maxNumSeqs": 4},
                                              "autoscaling": {"intervalSeconds": 1}})
        wait_until(lambda: condition(get_isvc(cluster, namespace, "hot"), "Ready").get("status") == "True", timeout=120, what="engine Ready")

        alert = wait_until(lambda: firing(prom, "KvpilotAutoscalerMetricsMissing", namespace), timeout=60, what="KvpilotAutoscalerMetricsMissing firing")
        assert alert["labels"]["inferenceservice"] == "hot"
        assert condition(get_isvc(cluster, namespace, "hot"), "ScalingActive")["reason"] == "MetricsUnavailable"

        api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        engine = ready_endpoints(api, cluster.server, namespace, "hot")[0]

        statuses = []

        def fill_cache(i: int) -> None:
            while not stop.is_set():
                try:
                    r = httpx.post(f"{engine}/v1/completions", timeout=60, json={"model": "hot", "prompt": f"Client {i} writes a long story: " * 4,
                                                                                 "max_tokens": 64, "temperature": 0, "ignore_eos": True})
                    statuses.append(r.status_code)
                except httpx.HTTPError as e:
                    statuses.append(type(e).__name__)

        clients = [threading.Thread(target=fill_cache, args=(i,), daemon=True) for i in range(4)]
        for c in clients:
            c.start()
        try:
            alert = wait_until(lambda: firing(prom, "KvpilotKVCacheSaturated", namespace), timeout=90, what="KvpilotKVCacheSaturated firing")
        except TimeoutError as e:
            peak = prom.query(f'max_over_time(kvpilot:kv_cache_usage_perc{{namespace="{namespace}"}}[2m])')
            raise AssertionError(f"{e}; engine answers {statuses[-8:]}; peak KV-cache use {peak}") from None
        assert alert["labels"]["inferenceservice"] == "hot" and float(alert["value"]) > 0.6
        stop.set()
        for c in clients:
            c.join(70)

        (proc,) = [e.proc for e in runner.engines.values() if e.namespace == namespace]
        os.killpg(proc.pid, signal.SIGKILL)  # the engine dies; the pod runner restarts it after a back-off
        alert = wait_until(lambda: firing(prom, "KvpilotEngineDown", namespace), timeout=60, what="KvpilotEngineDown firing")
        assert alert["labels"]["inferenceservice"] == "hot" and alert["labels"]["pod"].startswith("hot-")
    finally:
        stop.set()
        op.stop()
        runner.stop()
