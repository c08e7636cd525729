"""A whole Hugging Face checkpoint through the operator: an InferenceService with model.source
hf://org/repo (the hub: a loopback stand-in serving the tree listing and files of a tiny random
Qwen3 checkpoint written by transformers) gets an init container that runs `kvpilot fetch-model`
into the pod's volume; the engine loads that directory, becomes Ready and answers through its pod IP."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from e2e.cluster import TOKEN, _insecure
from e2e.hub import LoopbackHub
from e2e.isvc import apply_isvc, condition, get_isvc
from e2e.load import ready_endpoints
from e2e.operator_proc import OperatorProcess
from e2e.pod_runner import PodRunner
from e2e.waiting import wait_until

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_hf_checkpoint_source_is_fetched_and_served(cluster, namespace, tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoint_factory import CASES, build_checkpoint, save_tokenizer
    from kvpilot.server.model_files import resolve_model_path

    checkpoint = build_checkpoint(CASES["qwen3"], tmp_path / "hub" / "tiny-qwen3", save_tokenizer(resolve_model_path("smollm2-135m"), tmp_path / "tok"))
    hub = LoopbackHub({"org/tiny-qwen3": {f.name: f for f in sorted(checkpoint.iterdir())}})
    cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    runner = PodRunner(cluster.server, tmp_path / "pods").start()
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log")
    try:
        spec = {"model": {"source": "hf://org/tiny-qwen3", "servedName": "tiny"}, "resources": {"cpuOnly": True},
                "env": [{"name": "HF_ENDPOINT", "value": hub.url}], "engineSettings": {"kvCacheMemory": "32MiB", "maxModelLen": 256}}
        apply_isvc(cluster, namespace, "ckpt", spec)
        isvc = lambda: get_isvc(cluster, namespace, "ckpt")

        wait_until(lambda: condition(isvc(), "Ready").get("status") == "True", timeout=180, what="download + engine Ready")
        assert condition(isvc(), "Degraded").get("status") != "True", condition(isvc(), "Degraded")
        # The init container fetched the checkpoint's files (not the listing's other entries) into the pod's volume.
        fetched = {p.removeprefix("/org/tiny-qwen3/resolve/main/") for p in hub.requests if "/resolve/" in p}
        assert fetched == {f.name for f in checkpoint.iterdir()}
        [volume] = (tmp_path / "pods" / "volumes").glob("*/model/tiny-qwen3")
        assert sorted(p.name for p in volume.iterdir()) == sorted(f.name for f in checkpoint.iterdir())
        api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        [endpoint] = ready_endpoints(api, cluster.server, namespace, "ckpt")
        r = httpx.post(f"{endpoint}/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        cluster.kubectl("delete", "kvis", "ckpt", "-n", namespace, "--wait=true")
        wait_until(lambda: not runner.engines, timeout=60, what="engine stopped after delete")
    finally:
        op.stop()
        runner.stop()
        hub.close()
