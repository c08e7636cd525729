"""Autoscaling end to end: real engines (pod runner), real Prometheus (pod discovery), the operator,
the real control plane. Load builds a queue -> scale up -> the new pod serves -> load stops ->
scale back down after the window; Prometheus down -> no scale-down, ScalingActive=False."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from e2e.cluster import TOKEN, _insecure
from e2e.conftest import start_prometheus
from e2e.isvc import condition
from e2e.load import LoadGenerator, ready_endpoints
from e2e.operator_proc import OperatorProcess
from e2e.pod_runner import PodRunner
from e2e.waiting import wait_until

pytestmark = pytest.mark.cluster
ISVC = "serving.kvpilot.dev/inferenceservice"


def kget(cluster, *args):
    r = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


@pytest.fixture
def stack(cluster, namespace, prometheus_factory, tmp_path):
    cluster.kubectl("apply", "-f", str(Path(__file__).resolve().parents[1] / "crds"))
    prom = prometheus_factory("1s").add_kubernetes_pods(cluster.server, TOKEN, str(cluster.state_dir / "certs" / "apiserver.crt"))
    start_prometheus(prom)
    runner = PodRunner(cluster.server, tmp_path / "engines").start()
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", args=["--prometheus-url", prom.url])
    yield prom, runner, op
    op.stop()
    runner.stop()


def test_scale_up_under_load_and_back_down(cluster, namespace, stack):
    prom, runner, op = stack
    spec = {"model": {"source": "smollm2-135m"}, "minReplicas": 1, "maxReplicas": 2,
            "engineSettings": {"maxNumSeqs": 2, "kvCacheMemory": "64MiB", "maxModelLen": 1024},
            "autoscaling": {"targetQueueDepth": 1.0, "targetKvCacheUtilization": 0.95, "intervalSeconds": 2,
                            "scaleDownStabilizationSeconds": 20, "metricsStaleAfterSeconds": 10}}
    body = {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "auto"}, "spec": spec}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))

    def isvc():
        return kget(cluster, "kvis", "auto", "-n", namespace)

    wait_until(lambda: condition(isvc(), "Ready").get("status") == "True", timeout=120, what="first engine Ready (model load)")
    # idle: metrics flow, no scaling
    wait_until(lambda: condition(isvc(), "ScalingActive").get("status") == "True", timeout=30, what="ScalingActive with valid metrics")
    assert isvc()["spec"].get("replicas", 1) == 1

    api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    load = LoadGenerator(api, cluster.server, namespace, "auto", clients=6, max_tokens=48, max_seconds=200).start()
    t0 = time.monotonic()
    try:
        up = wait_until(lambda: [h for h in isvc()["status"].get("scalingHistory", []) if h["to"] > h["from"]], timeout=90, what="scale-up decision")
        t_decision = time.monotonic() - t0
        assert up[0]["from"] == 1 and up[0]["to"] == 2 and "queue" in up[0]["reason"]
        wait_until(lambda: isvc()["status"].get("readyReplicas") == 2, timeout=150, what="second replica Ready")
        t_ready = time.monotonic() - t0
        endpoints = wait_until(lambda: (lambda e: e if len(e) == 2 else None)(ready_endpoints(api, cluster.server, namespace, "auto")),
                               timeout=30, what="2 ready endpoints")
        wait_until(lambda: all(load.sent[e] > 0 for e in endpoints), timeout=60, what="the new pod gets traffic")
        changes_before = len(isvc()["status"]["scalingHistory"])
        time.sleep(8)  # steady load at max replicas: any change now is a flap
        flaps = isvc()["status"]["scalingHistory"][changes_before:]
    finally:
        load.stop()
    assert not flaps, flaps
    assert set(load.statuses) <= {200, 429}, load.statuses  # never a 5xx or a connection error under load
    served = {e: httpx.get(e + "/metrics").text for e in endpoints}
    for e, text in served.items():
        gen = [line for line in text.splitlines() if line.startswith("kvpilot:generation_tokens_total")]
        assert gen and float(gen[0].split()[-1]) > 0, f"{e} generated nothing"

    # Prometheus down: metrics unavailable -> hold at 2 (never scale down on missing data)
    prom.stop()
    obj = wait_until(lambda: (lambda o: o if condition(o, "ScalingActive").get("reason") == "MetricsUnavailable" else None)(isvc()),
                     timeout=20, what="ScalingActive=False/MetricsUnavailable")
    assert condition(obj, "ScalingActive")["status"] == "False"
    time.sleep(22)  # longer than the 20 s window
    assert isvc()["spec"]["replicas"] == 2
    start_prometheus(prom)

    down = wait_until(lambda: [h for h in isvc()["status"].get("scalingHistory", []) if h["to"] < h["from"]], timeout=120, what="scale-down")
    assert down[-1]["from"] == 2 and down[-1]["to"] == 1 and "highest recommendation" in down[-1]["reason"]
    wait_until(lambda: isvc()["status"].get("readyReplicas") == 1 and isvc()["status"].get("replicas") == 1, timeout=60, what="back to 1 pod")
    events = kget(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=auto")["items"]
    reasons = [e["reason"] for e in events]
    assert "ScaledUp" in reasons and "ScaledDown" in reasons
    scaled_up = next(e for e in events if e["reason"] == "ScaledUp")
    assert "queue" in scaled_up["message"] and "scale up 1 -> 2" in scaled_up["message"]
    history = isvc()["status"]["scalingHistory"]
    print(f"\nautoscaling e2e: scale-up decision {t_decision:.1f}s after load start, new replica Ready after {t_ready:.1f}s; "
          f"steady-load flaps: {len(flaps)}; history: {[(h['from'], h['to']) for h in history]}; requests: {dict(load.statuses)}")
