"""Speculative decoding through the operator: an InferenceService with engineSettings.speculative
runs a real kvpilot engine (pod runner) that speculates, is Ready with no Degraded condition, and
answers through its pod IP with its spec_decode metrics counting."""

from __future__ import annotations

import json
import re
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


def test_ngram_speculation_runs_in_the_engine_pod(cluster, namespace, tmp_path):
    cluster.kubectl("apply", "-f", str(Path(__file__).resolve().parents[1] / "crds"))
    runner = PodRunner(cluster.server, tmp_path / "engines").start()
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log")
    try:
        spec = {"model": {"source": "smollm2-135m"}, "resources": {"cpuOnly": True},
                "engineSettings": {"maxNumSeqs": 4, "kvCacheMemory": "64MiB", "maxModelLen": 1024,
                                   "speculative": {"method": "ngram", "numSpeculativeTokens": 4}}}
        apply_isvc(cluster, namespace, "spec", spec)
        isvc = lambda: get_isvc(cluster, namespace, "spec")

        wait_until(lambda: condition(isvc(), "Ready").get("status") == "True", timeout=120, what="engine Ready (model load)")
        assert condition(isvc(), "Degraded").get("status") != "True", condition(isvc(), "Degraded")
        api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        [endpoint] = ready_endpoints(api, cluster.server, namespace, "spec")
        code = "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return add(add(a, b), c)\n\ndef add4(a, b, c, d):\n    return"
        r = httpx.post(f"{endpoint}/v1/completions", json={"model": "spec", "prompt": code, "max_tokens": 40, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
        # Streamed, the multi-token steps arrive as deltas that add up to the same text.
        with httpx.stream("POST", f"{endpoint}/v1/completions", timeout=120,
                          json={"model": "spec", "prompt": code, "max_tokens": 40, "temperature": 0, "stream": True}) as stream:
            events = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        deltas = [json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]]
        assert "".join(deltas) == r.json()["choices"][0]["text"] and max(len(d) for d in deltas) > 0
        metrics = httpx.get(f"{endpoint}/metrics", timeout=10).text
        accepted = re.search(r'^kvpilot:spec_decode_num_accepted_tokens_total\{model_name="spec"\} (\S+)$', metrics, re.M)
        drafts = re.search(r'^kvpilot:spec_decode_num_drafts_total\{model_name="spec"\} (\S+)$', metrics, re.M)
        assert accepted and drafts and float(accepted.group(1)) > 0 and float(drafts.group(1)) > 0, metrics
    finally:
        op.stop()
        runner.stop()
