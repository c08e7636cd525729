"""The operator at scale, on the real control plane (issue #42): reads come from its watch cache and status
is written only when more than a timestamp changed, so 50 idle InferenceServices cost the API server
almost nothing; the scale-down window is in status, so killing the leader mid-window does not restart it."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest

from e2e.conftest import start_prometheus
from e2e.fake_exporter import Exporter
from e2e.isvc import API_VERSION, condition, get_isvc
from e2e.net import free_port
from e2e.operator_proc import OperatorProcess
from e2e.waiting import wait_until
from kvpilot.operator.kube import USER_AGENT

pytestmark = pytest.mark.cluster
SERVICES = 50
WINDOW_SECONDS = 30  # 6 autoscaler ticks per service (every 5 s); the bound is per minute
COUNTED = ("inferenceservices", "pods", "deployments", "services")
CRDS = str(Path(__file__).resolve().parents[1] / "crds")
READY_ANNOTATION = "serving.kvpilot.dev/engine-ready"  # kwok makes an engine pod Ready while it is "true" (kwok_stages.yaml)


def operator_events(cluster, start: float, end: float) -> list[dict]:
    """The operator's requests (its client's and kopf's user agents) to the counted kinds between two
    times, from the API server's audit log (watches are not logged)."""
    events = []
    for line in cluster.audit_log.read_text().splitlines():
        event = json.loads(line)
        when = datetime.fromisoformat(event["stageTimestamp"].replace("Z", "+00:00")).timestamp()
        agent = event.get("userAgent", "")
        if start <= when < end and (agent.startswith(USER_AGENT) or agent.startswith("kopf/")) and \
                (event.get("objectRef") or {}).get("resource") in COUNTED:
            events.append({**event, "when": when})
    return events


def operator_requests(cluster, start: float, end: float) -> Counter:
    """operator_events counted by (verb, resource, subresource)."""
    return Counter((e["verb"], e["objectRef"]["resource"], e["objectRef"].get("subresource", "")) for e in operator_events(cluster, start, end))


def wait_for_quiet(cluster, since: float, quiet: float = 15, timeout: float = 150) -> None:
    """Until the operator has made no request for `quiet` seconds: the roll-out's last events are
    handled (a slow machine lags behind the cluster; an operator that never goes quiet fails here)."""
    deadline = time.time() + timeout
    while True:
        events = operator_events(cluster, since, time.time() + 1)
        last = max((e["when"] for e in events), default=since)
        if time.time() - last >= quiet:
            return
        assert time.time() < deadline, f"the operator never went {quiet:g} s without a request: {Counter(e['verb'] for e in events)}"
        time.sleep(2)


def isvc_list(namespace: str, spec: dict, count: int) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": API_VERSION, "kind": "InferenceService", "metadata": {"name": f"svc-{i:02d}", "namespace": namespace}, "spec": spec}
        for i in range(count)]})


@pytest.mark.timeout(420)
def test_fifty_idle_services_cost_the_api_server_almost_nothing(cluster, namespace, tmp_path):
    cluster.kubectl("apply", "-f", CRDS)
    # this namespace only (earlier tests' objects may still be going away elsewhere); nobody at the
    # Prometheus URL: metrics unavailable, a steady hold
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", lease_namespace=namespace,
                         args=["--namespace", namespace, "--prometheus-url", f"http://127.0.0.1:{free_port()}"])
    try:
        spec = {"model": {"source": "smollm2-135m"}, "minReplicas": 1, "maxReplicas": 2, "resources": {"cpuOnly": True},
                "autoscaling": {"intervalSeconds": 5}}
        cluster.kubectl("apply", "-f", "-", input=isvc_list(namespace, spec, SERVICES), timeout=120)

        def settled() -> bool:
            items = json.loads(cluster.kubectl("get", "kvis", "-n", namespace, "-o", "json").stdout)["items"]
            pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
            running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
            return len(items) == SERVICES and len(running) == SERVICES and all(
                condition(o, "ScalingActive").get("reason") == "MetricsUnavailable" and (o.get("status") or {}).get("replicas") == 1
                for o in items)

        applied = time.time()
        wait_until(settled, timeout=180, what=f"{SERVICES} services with their pod and an autoscaler verdict")
        wait_for_quiet(cluster, applied)
        start = time.time()
        time.sleep(WINDOW_SECONDS)
        time.sleep(2)  # the audit log's last lines
        counted = operator_requests(cluster, start, start + WINDOW_SECONDS)
        per_service_minute = sum(counted.values()) / SERVICES / (WINDOW_SECONDS / 60)
        print(f"\nthe operator's API requests over {WINDOW_SECONDS}s with {SERVICES} idle services (verb, resource, subresource: count): "
              f"{dict(sorted(counted.items()))}; {sum(counted.values()):g} = {per_service_minute:.3f} per service per minute")
        which = [(e["verb"], e["objectRef"]["resource"], e["objectRef"].get("name")) for e in operator_events(cluster, start, start + WINDOW_SECONDS)]
        assert per_service_minute <= 0.1, (counted, which, [line for line in op.log().splitlines() if "reconciling" in line][-20:])
        assert "Traceback" not in op.log()
    finally:
        op.stop()


@pytest.mark.timeout(300)
def test_killing_the_leader_mid_window_keeps_the_scale_down_window(cluster, namespace, prometheus_factory, tmp_path):
    """Two pods, idle (each recommendation is 1), a 30 s window: the first leader is killed halfway; the
    one that takes over scales down when the window that began under the first one ends, not a
    window after it took over."""
    cluster.kubectl("apply", "-f", CRDS)
    name, window = "steady", 30
    spec = {"model": {"source": "smollm2-135m"}, "replicas": 2, "minReplicas": 1, "maxReplicas": 3, "resources": {"cpuOnly": True},
            "autoscaling": {"intervalSeconds": 2, "scaleDownStabilizationSeconds": window, "metricsStaleAfterSeconds": 10,
                            "targetQueueDepth": 1, "targetKvCacheUtilization": 0.9}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc_list(namespace, spec, 1).replace("svc-00", name))

    def pods() -> list[str]:
        items = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
        return [p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp")]

    # pods first (the first operator makes them), then their metrics: idle engines
    first = OperatorProcess(cluster.kubeconfig, tmp_path / "op-start.log", env={"POD_NAME": "op-start"}, lease_namespace=namespace,
                            args=["--namespace", namespace])
    second = None
    exporters = []
    try:
        names = wait_until(lambda: (lambda p: p if len(p) == 2 else None)(pods()), timeout=60, what="two engine pods")
        for pod in names:
            cluster.kubectl("annotate", "pod", pod, "-n", namespace, f"{READY_ANNOTATION}=true")
        prom = prometheus_factory("1s")
        for pod in names:
            exporters.append(Exporter("kvpilot:kv_cache_usage_perc 0.0\nkvpilot:num_requests_waiting 0\n"))
            prom.add_static(f"engine-{pod}", [f"127.0.0.1:{exporters[-1].port}"], {"namespace": namespace, "inferenceservice": name, "pod": pod})
        start_prometheus(prom)
        first.stop()  # now lead with Prometheus known: the first leader of the window, and the standby
        args = ["--namespace", namespace, "--prometheus-url", prom.url]
        first = OperatorProcess(cluster.kubeconfig, tmp_path / "op-a.log", env={"POD_NAME": "op-a"}, lease_namespace=namespace, args=args)
        second = OperatorProcess(cluster.kubeconfig, tmp_path / "op-b.log", env={"POD_NAME": "op-b"}, lease_namespace=namespace, args=args)
        saved = wait_until(lambda: ((get_isvc(cluster, namespace, name) or {}).get("status") or {}).get("scaleDownWindow"),
                           timeout=60, what="the window in status")
        began = datetime.fromisoformat(saved["since"].replace("Z", "+00:00")).timestamp()
        assert saved["levels"] == [{"replicas": 1}] and get_isvc(cluster, namespace, name)["spec"]["replicas"] == 2
        time.sleep(max(0.0, began + window / 2 - time.time()))
        leader = next(op for op in (first, second) if "leading as" in op.log())
        os.killpg(leader.proc.pid, signal.SIGKILL)  # halfway through the window, no clean hand-over
        killed = time.time()
        down = wait_until(lambda: next((h for h in (get_isvc(cluster, namespace, name).get("status") or {}).get("scalingHistory", [])
                                        if h["to"] < h["from"]), None), timeout=window + 30, what="the scale-down in status")
        at = datetime.fromisoformat(down["time"].replace("Z", "+00:00")).timestamp()
        print(f"\nwindow began {began:.0f}, leader killed after {killed - began:.1f}s, scaled down after {at - began:.1f}s "
              f"(window {window}s; a restarted window would end {killed - began + window:.0f}s or later after it began)")
        assert (down["from"], down["to"]) == (2, 1) and "highest recommendation" in down["reason"]
        assert began + window - 1 <= at <= began + window + 8, (at - began, down)
        assert "leading as" in (second if leader is first else first).log()
    finally:
        for op in (first, second):
            if op is not None:
                op.stop()
        for e in exporters:
            e.close()
