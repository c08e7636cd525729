"""Prefill/decode disaggregation on the local control plane (#44): an InferenceService with
spec.disaggregation gets a prefill pool (Deployment <name>-prefill) beside its decode pods; through
kvpilot-gateway each request is prefilled on the prefill pod and decoded on the decode pod, which pulls
the prompt's KV blocks (both pods' metrics say so) and answers the text one engine gives when it serves
the request alone. Then the prefill pool scales on its own queue while the decode pool, idle,
holds."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from e2e.cluster import TOKEN, _insecure
from e2e.conftest import start_prometheus
from e2e.gateway_proc import GatewayProcess
from e2e.isvc import apply_isvc, get_isvc
from e2e.load import ready_endpoints
from e2e.net import require_loopback
from e2e.operator_proc import OperatorProcess
from e2e.pod_runner import PodRunner
from e2e.waiting import wait_until

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Notes from the harbour master. " + " ".join(f"Ship {i} docked at pier {i % 5} with {i * 7 % 11} crates of tea." for i in range(12))


def sample(endpoint: str, name: str) -> float:
    text = httpx.get(f"{endpoint}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def complete(url: str, prompt: str = PROMPT, max_tokens: int = 12) -> httpx.Response:
    r = httpx.post(f"{url}/v1/completions", timeout=180, json={"model": "pd", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def prefill_endpoints(api: httpx.Client, server: str, namespace: str) -> list[str]:
    r = api.get(f"{server}/api/v1/namespaces/{namespace}/pods",
                params={"labelSelector": "serving.kvpilot.dev/inferenceservice=pd,serving.kvpilot.dev/role=prefill"})
    r.raise_for_status()
    return sorted(f"http://{require_loopback(p['status']['podIP'])}:8000" for p in r.json()["items"]
                  if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or []))


@pytest.mark.timeout(420)
def test_prefill_and_decode_pools_serve_through_the_gateway_and_scale_apart(cluster, namespace, prometheus_factory, tmp_path):
    cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    prom = prometheus_factory("1s").add_kubernetes_pods(cluster.server, TOKEN, str(cluster.state_dir / "certs" / "apiserver.crt"))
    start_prometheus(prom)
    runner = PodRunner(cluster.server, tmp_path / "pods").start()
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", args=["--prometheus-url", prom.url])
    gateway = GatewayProcess(cluster.kubeconfig, namespace, tmp_path / "gateway.log")
    api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    try:
        apply_isvc(cluster, namespace, "pd", {
            "model": {"source": "smollm2-135m", "servedName": "pd"}, "resources": {"cpuOnly": True}, "minReplicas": 1, "maxReplicas": 2,
            "engineSettings": {"kvCacheMemory": "24MiB", "maxModelLen": 512, "maxNumSeqs": 1},
            "autoscaling": {"intervalSeconds": 2, "targetQueueDepth": 4, "targetKvCacheUtilization": 0.95, "metricsStaleAfterSeconds": 10,
                            "scaleDownStabilizationSeconds": 600},
            "disaggregation": {"prefill": {"minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": 0.5}}})

        def pools_ready():
            status = (get_isvc(cluster, namespace, "pd") or {}).get("status") or {}
            return status.get("readyReplicas") == 1 and (status.get("prefill") or {}).get("readyReplicas") == 1
        wait_until(pools_ready, timeout=180, what="1 decode and 1 prefill pod Ready")
        table = cluster.kubectl("get", "kvis", "pd", "-n", namespace).stdout.splitlines()
        header, row = table[0].split(), table[1].split()
        assert dict(zip(header, row, strict=False))["PREFILL"] == "1", table
        (decode,) = ready_endpoints(api, cluster.server, namespace, "pd")  # the Service: decode pods only
        (prefill,) = prefill_endpoints(api, cluster.server, namespace)
        assert decode != prefill
        # The pools' shared key (made once) and the NetworkPolicy keeping their transfer port to themselves
        key = json.loads(cluster.kubectl("get", "secret", "pd-kv-transfer", "-n", namespace, "-o", "json").stdout)
        assert key["immutable"] is True and len(key["data"]["key"]) >= 32
        policy = json.loads(cluster.kubectl("get", "networkpolicy", "pd-kv-transfer", "-n", namespace, "-o", "json").stdout)["spec"]
        assert policy["ingress"][0] == {"from": [{"podSelector": policy["podSelector"]}],  # the transfer port and NIXL's data ports
                                        "ports": [{"protocol": "TCP", "port": 5600}, {"protocol": "TCP", "port": 5601, "endPort": 5699}]}

        # The gateway has the prefill pod once its watch has seen it Ready.
        def disaggregated_answer():
            r = complete(gateway.url)
            return r if sample(gateway.url, 'kvpilot_gateway_prefill_requests_total{model="pd",outcome="handed_off"}') >= 1 else None
        answer = wait_until(disaggregated_answer, timeout=60, what="a request prefilled on the prefill pod")
        assert answer.headers["x-kvpilot-endpoint"].removeprefix("http://") == decode.removeprefix("http://")
        prompt_tokens = answer.json()["usage"]["prompt_tokens"]
        pulled = sample(decode, "kvpilot:kv_transfer_pulled_blocks_total")
        assert pulled >= (prompt_tokens - 1) // 16 >= 8 and sample(prefill, "kvpilot:kv_transfer_sent_blocks_total") >= pulled
        assert sample(decode, "kvpilot:kv_transfer_failed_pulls_total") == 0
        # (the decode pod tells the prefill pod its ranks have read the blocks, in the background: the hold ends then)
        wait_until(lambda: sample(prefill, "kvpilot:kv_transfer_held_blocks") == 0, timeout=10, what="the prefill pod's hold released")
        # The same text as one engine serving the request alone, from K/V it computed itself: the prefill pod
        # (the decode pod's cache now holds the pulled blocks)
        alone = complete(prefill)
        assert alone.json()["choices"][0]["text"] == answer.json()["choices"][0]["text"]

        # The prefill pool scales on its own queue: requests queue at the prefill pod (one sequence at a time)
        # while the decode pod is idle; the decode pool holds.
        def isvc_spec():
            return (get_isvc(cluster, namespace, "pd") or {}).get("spec") or {}
        with ThreadPoolExecutor(4) as pool:
            burst = [pool.submit(complete, prefill, f"Burst {i}. " + PROMPT, 160) for i in range(4)]
            wait_until(lambda: ((isvc_spec().get("disaggregation") or {}).get("prefill") or {}).get("replicas") == 2, timeout=90,
                       what="the prefill pool scaled up on its queue")
            for f in burst:
                f.result()
        assert isvc_spec().get("replicas", 1) == 1
        deployment = json.loads(cluster.kubectl("get", "deployment", "pd-prefill", "-n", namespace, "-o", "json").stdout)
        assert deployment["spec"]["replicas"] == 2
        events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=pd", "-o", "json").stdout
        assert any(e["reason"] == "ScaledUp" and e["message"].startswith("prefill pool: scale up 1 -> 2")
                   for e in json.loads(events)["items"]), events
        status = (get_isvc(cluster, namespace, "pd") or {}).get("status") or {}
        assert status["prefill"]["desiredReplicas"] == 2 and status["desiredReplicas"] == 1, status

        # Disaggregation off: the prefill pool goes, the Service's pods serve alone.
        spec = isvc_spec()
        spec.pop("disaggregation")
        apply_isvc(cluster, namespace, "pd", spec)
        wait_until(lambda: cluster.kubectl("get", "deployment", "pd-prefill", "-n", namespace, check=False).returncode != 0, timeout=60,
                   what="the prefill Deployment deleted")
        wait_until(lambda: "prefill" not in ((get_isvc(cluster, namespace, "pd") or {}).get("status") or {}), timeout=60,
                   what="status without a prefill pool")
        assert cluster.kubectl("get", "networkpolicy", "pd-kv-transfer", "-n", namespace, check=False).returncode != 0
    finally:
        gateway.stop()
        op.stop()
        runner.stop()
