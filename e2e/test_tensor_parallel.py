"""Tensor parallelism through the operator: a `tensorParallelSize: 3` InferenceService gets a pod
that asks for 3 GPUs on a kwok GPU node, whose engine (3 ranks, gloo on this CPU, run by the pod
runner) becomes Ready and answers; a `tensorParallelSize: 2` one cannot be split over SmolLM2's 9
heads: its engine exits with that reason, which reaches the InferenceService's Degraded condition
through the container's termination message."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from e2e.cluster import TOKEN, _insecure
from e2e.isvc import apply_isvc, condition, get_isvc
from e2e.load import ready_endpoints
from e2e.operator_proc import OperatorProcess
from e2e.pod_runner import PodRunner
from e2e.waiting import wait_until

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(300)
def test_three_ranks_serve_and_two_are_refused_in_the_status(cluster, namespace, tmp_path):
    cluster.kubectl("apply", "-f", str(Path(__file__).resolve().parents[1] / "crds"))
    runner = PodRunner(cluster.server, tmp_path / "pods").start()
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log")
    try:
        for name, world in (("tp3", 3), ("tp2", 2)):
            apply_isvc(cluster, namespace, name, {"model": {"source": "smollm2-135m"},
                                                  "engineSettings": {"tensorParallelSize": world, "kvCacheMemory": "32MiB", "maxModelLen": 512}})
        isvc = lambda name: get_isvc(cluster, namespace, name)

        wait_until(lambda: condition(isvc("tp3"), "Ready").get("status") == "True", timeout=180, what="3-rank engine Ready")
        assert condition(isvc("tp3"), "Degraded").get("status") != "True", condition(isvc("tp3"), "Degraded")
        [pod] = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", "serving.kvpilot.dev/inferenceservice=tp3", "-o", "json").stdout)["items"]
        engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "3" and pod["spec"]["nodeName"].startswith("gpu-node")
        assert engine["args"][engine["args"].index("--tensor-parallel-size") + 1] == "3"
        api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        [endpoint] = ready_endpoints(api, cluster.server, namespace, "tp3")
        r = httpx.post(f"{endpoint}/v1/completions", json={"model": "tp3", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text

        wait_until(lambda: "9 query heads" in condition(isvc("tp2"), "Degraded").get("message", ""), timeout=120,
                   what="tp2's refusal in its Degraded condition")
        degraded = condition(isvc("tp2"), "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "CrashLoopBackOff" and "tensor_parallel_size=2" in degraded["message"]
        assert condition(isvc("tp2"), "Ready").get("status") == "False"
    finally:
        op.stop()
        runner.stop()
