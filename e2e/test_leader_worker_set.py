"""Replicas of several pods through LeaderWorkerSet (its controller and webhooks built and run here, e2e/lws.py): an
InferenceService whose engine's two pipeline stages get one pod each (resources.gpusPerPod 1) becomes a LeaderWorkerSet
group, leader and worker, whose ranks meet at the leader's address; its greedy completions equal a one-pod replica's.
The worker's process killed: the group is recreated (the restart policy), the Degraded condition's Event names the
worker, and it serves again. Scaled 1 -> 2 groups under load and back through the scale subresource, every request
answered; deleted, the group goes with it."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from e2e.cluster import TOKEN, _insecure
from e2e.isvc import apply_isvc, condition, get_isvc
from e2e.load import ready_endpoints
from e2e.lws import start_lws
from e2e.operator_proc import OperatorProcess
from e2e.pod_runner import PodRunner
from e2e.waiting import wait_until

pytestmark = pytest.mark.cluster

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colours of the rainbow are"]
ENGINE = {"kvCacheMemory": "32MiB", "maxModelLen": 512}


def pods_of(cluster, namespace: str, name: str) -> list[dict]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", f"serving.kvpilot.dev/inferenceservice={name}", "-o", "json").stdout
    return [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]


def completions(endpoint: str, model: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        r = httpx.post(f"{endpoint}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    return texts


def groups_ready(cluster, namespace: str, name: str, count: int) -> bool:
    status = (get_isvc(cluster, namespace, name) or {}).get("status") or {}
    groups = status.get("groups") or []
    return len(groups) == count and all(g["ready"] for g in groups) and status.get("readyReplicas") == count


@pytest.mark.timeout(480)
def test_a_replica_of_two_pods_serves_recovers_and_scales(cluster, namespace, tmp_path):
    cluster.kubectl("apply", "-f", str(Path(__file__).resolve().parents[1] / "crds"))
    start_lws(cluster)
    runner = PodRunner(cluster.server, tmp_path / "pods").start()
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log")
    api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    group_spec = {"model": {"source": "smollm2-135m"}, "resources": {"cpuOnly": True, "gpusPerPod": 1}, "autoscaling": {"enabled": False},
                  "engineSettings": {**ENGINE, "pipelineParallelSize": 2}, "minReplicas": 1, "maxReplicas": 2}
    try:
        apply_isvc(cluster, namespace, "grp", group_spec)
        apply_isvc(cluster, namespace, "solo", {"model": {"source": "smollm2-135m"}, "resources": {"cpuOnly": True}, "engineSettings": ENGINE,
                                                "autoscaling": {"enabled": False}})
        wait_until(lambda: groups_ready(cluster, namespace, "grp", 1), timeout=240, what="the group of two pods Ready")
        wait_until(lambda: condition(get_isvc(cluster, namespace, "solo"), "Ready").get("status") == "True", timeout=120, what="solo Ready")
        lws = json.loads(cluster.kubectl("get", "leaderworkersets", "grp-group", "-n", namespace, "-o", "json").stdout)
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2 and lws["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
        pods = {p["metadata"]["name"]: p for p in pods_of(cluster, namespace, "grp")}
        assert sorted(pods) == ["grp-group-0", "grp-group-0-1"]
        worker = pods["grp-group-0-1"]["spec"]["containers"][0]
        assert worker["args"][0] == "serve-worker" and {"LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX"} <= {e["name"] for e in worker["env"]}  # the webhook's
        [endpoint] = ready_endpoints(api, cluster.server, namespace, "grp")  # the leader alone behind the Service
        assert endpoint.removeprefix("http://").split(":")[0] == pods["grp-group-0"]["status"]["podIP"]
        [solo] = ready_endpoints(api, cluster.server, namespace, "solo")
        expected = completions(solo, "solo")
        assert completions(endpoint, "grp") == expected

        # The worker's process dies: LeaderWorkerSet recreates the whole group; the operator's Degraded Event names the worker.
        leader_uid = pods["grp-group-0"]["metadata"]["uid"]
        proc = next(e.proc for e in runner.engines.values() if e.pod == "grp-group-0-1")
        os.killpg(proc.pid, signal.SIGKILL)
        events = lambda: json.loads(cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=grp",  # noqa: E731
                                                    "-o", "json").stdout)["items"]
        wait_until(lambda: any(e["type"] == "Warning" and "grp-group-0-1" in e["message"] for e in events()), timeout=60,
                   what="a Warning Event naming the failed worker")
        wait_until(lambda: {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods_of(cluster, namespace, "grp")}.get("grp-group-0")
                   not in (None, leader_uid), timeout=60, what="the group recreated (a new leader pod)")
        wait_until(lambda: groups_ready(cluster, namespace, "grp", 1), timeout=240, what="the recreated group Ready")
        [endpoint] = ready_endpoints(api, cluster.server, namespace, "grp")
        assert completions(endpoint, "grp") == expected

        # 1 -> 2 groups and back through the scale subresource while requests keep coming: every one answered.
        answers, stop = [], threading.Event()

        def load() -> None:
            while not stop.is_set():
                for attempt in range(3):  # a request that meets a group going away is sent again to one that stays
                    try:
                        targets = ready_endpoints(api, cluster.server, namespace, "grp")
                        target = targets[attempt % len(targets)]
                        r = httpx.post(f"{target}/v1/completions", json={"model": "grp", "prompt": PROMPTS[0], "max_tokens": 4,
                                                                          "temperature": 0}, timeout=120)
                        answers.append(r.status_code)
                        break
                    except (httpx.TransportError, ZeroDivisionError):
                        continue
                else:
                    answers.append(None)

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        cluster.kubectl("scale", "kvis", "grp", "-n", namespace, "--replicas=2")
        wait_until(lambda: groups_ready(cluster, namespace, "grp", 2), timeout=240, what="two groups Ready")
        scale = cluster.api(f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{namespace}/leaderworkersets/grp-group/scale")
        assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2  # LeaderWorkerSet's own scale subresource: 2 groups
        assert len(ready_endpoints(api, cluster.server, namespace, "grp")) == 2  # two leaders, no worker
        cluster.kubectl("scale", "kvis", "grp", "-n", namespace, "--replicas=1")
        wait_until(lambda: groups_ready(cluster, namespace, "grp", 1) and len(pods_of(cluster, namespace, "grp")) == 2, timeout=120,
                   what="back to one group")
        stop.set()
        loader.join(timeout=130)
        assert answers and all(a == 200 for a in answers), answers

        cluster.kubectl("delete", "kvis", "grp", "-n", namespace)
        wait_until(lambda: cluster.kubectl("get", "leaderworkersets", "grp-group", "-n", namespace, check=False).returncode != 0 and
                   not pods_of(cluster, namespace, "grp"), timeout=90, what="the group deleted with its InferenceService")
    finally:
        op.stop()
        runner.stop()
