"""The KV cache's disk tier shared by the replicas of one InferenceService (#43), on the local control
plane: engineSettings.kvOffload (Shared) gets a ReadWriteMany claim owned by the service (bound by the
controller-manager to a pre-made host-directory PersistentVolume) that both engine pods mount at their
--kv-offload-dir; a long prompt served by one pod is read back from the tier by the other (its metrics
say so) with the same completion, and the claim goes with the service."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from e2e.cluster import TOKEN, _insecure
from e2e.isvc import apply_isvc
from e2e.load import ready_endpoints
from e2e.operator_proc import OperatorProcess
from e2e.pod_runner import PodRunner
from e2e.waiting import wait_until

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]
PROMPT = "A field guide to the birds of the northern coast. " + " ".join(f"Entry {i}: the bird number {i} nests on cliff {i * 3 % 7}." for i in range(14))


def metrics(endpoint: str) -> dict[str, float]:
    """An engine's kvpilot:kv_offload_* samples by name."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{endpoint}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name.startswith("kvpilot:kv_offload")}


def complete(endpoint: str) -> dict:
    r = httpx.post(f"{endpoint}/v1/completions", timeout=120, json={"model": "birds", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.timeout(300)
def test_two_replicas_share_the_disk_tier(cluster, namespace, tmp_path):
    cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    cluster.add_host_volumes(1, tmp_path / "volumes", size="1Gi", prefix=f"kv-{namespace}")
    runner = PodRunner(cluster.server, tmp_path / "pods").start()
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log")
    api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    try:
        apply_isvc(cluster, namespace, "birds", {
            "model": {"source": "smollm2-135m", "servedName": "birds"}, "replicas": 2, "minReplicas": 1, "maxReplicas": 2,
            "autoscaling": {"enabled": False}, "resources": {"cpuOnly": True},
            "engineSettings": {"kvCacheMemory": "24MiB", "maxModelLen": 512,
                               "kvOffload": {"mode": "Shared", "size": "1Gi", "storageClassName": "kvpilot-local"}}})
        wait_until(lambda: len(ready_endpoints(api, cluster.server, namespace, "birds")) == 2, timeout=180, what="2 replicas Ready")
        claim = json.loads(cluster.kubectl("get", "pvc", "birds-kv-tier", "-n", namespace, "-o", "json").stdout)
        assert claim["status"]["phase"] == "Bound" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
        assert claim["metadata"]["ownerReferences"][0]["name"] == "birds"
        first, second = ready_endpoints(api, cluster.server, namespace, "birds")
        served = complete(first)
        wait_until(lambda: metrics(first)["kvpilot:kv_offload_saved_blocks_total"] >= 8, timeout=30, what="the first pod's blocks saved")
        assert metrics(second)["kvpilot:kv_offload_hit_blocks_total"] == 0
        again = complete(second)
        assert again["choices"][0]["text"] == served["choices"][0]["text"]
        m = metrics(second)
        blocks = (again["usage"]["prompt_tokens"] - 1) // 16
        assert m["kvpilot:kv_offload_hit_blocks_total"] == blocks and m["kvpilot:kv_offload_refused_files_total"] == 0, m
        print(f"\nsecond replica: {blocks} blocks of a {again['usage']['prompt_tokens']}-token prompt read from the shared tier "
              f"({m['kvpilot:kv_offload_loaded_bytes_total'] / 2**20:.1f} MiB in {m['kvpilot:kv_offload_load_seconds_total']:.3f} s)")
        cluster.kubectl("delete", "kvis", "birds", "-n", namespace, "--wait=true")
        wait_until(lambda: cluster.kubectl("get", "pvc", "birds-kv-tier", "-n", namespace, check=False).returncode != 0, timeout=60,
                   what="the tier's claim deleted with its service")
    finally:
        op.stop()
        runner.stop()
