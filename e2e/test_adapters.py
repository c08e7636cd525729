"""LoRA adapters through the operator and the gateway: an InferenceService with two adapters (hf://
sources on a loopback hub) gets both loaded into its pod through the engine's run-time API (status
per adapter, AdaptersReady); a completion for each through kvpilot-gateway equals the engine's own;
a second replica gets both; an adapter removed from the spec is unloaded from every pod and is a 404.
The API key comes from the service's Secret."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from e2e.cluster import TOKEN, _insecure
from e2e.gateway_proc import GatewayProcess
from e2e.hub import LoopbackHub
from e2e.isvc import apply_isvc, condition, get_isvc
from e2e.load import ready_endpoints
from e2e.operator_proc import OperatorProcess
from e2e.pod_runner import PodRunner
from e2e.waiting import wait_until

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]
KEY = "adapter-test-key"
# SmolLM2-135M's q_proj (576 -> 576) and v_proj (576 -> 192), 30 layers: a wrong shape is refused by name at load.
LAYERS, HIDDEN, KV = 30, 576, 192


def write_adapter(dest: Path, seed: int) -> dict[str, Path]:
    """A PEFT LoRA adapter (rank 8 on q_proj and v_proj, B not zero: it changes the outputs) as peft saves one."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module, out in (("q_proj", HIDDEN), ("v_proj", KV)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, HIDDEN, generator=g) * HIDDEN ** -0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, 8, generator=g) * 0.05
    dest.mkdir(parents=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                                                          "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))
    return {p.name: p for p in dest.iterdir()}


@pytest.mark.timeout(420)
def test_adapters_loaded_routed_and_unloaded(cluster, namespace, tmp_path):
    hub = LoopbackHub({"org/sql": write_adapter(tmp_path / "sql", 1), "org/poet": write_adapter(tmp_path / "poet", 2)})
    cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    cluster.kubectl("create", "secret", "generic", "engine-key", "-n", namespace, f"--from-literal=key={KEY}")
    runner = PodRunner(cluster.server, tmp_path / "pods").start()
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log")
    gateway = GatewayProcess(cluster.kubeconfig, namespace, tmp_path / "gateway.log")
    api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    auth = {"Authorization": f"Bearer {KEY}"}
    isvc = lambda: get_isvc(cluster, namespace, "base") or {}

    def loaded(names: dict[str, int]) -> bool:
        obj = isvc()
        seen = {a["name"]: a.get("loadedPods", 0) for a in (obj.get("status") or {}).get("adapters") or []}, condition(obj, "AdaptersReady")
        assert seen[0] == names and seen[1].get("status") == "True", seen  # what a timeout reports
        return True

    def complete(url: str, model: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", headers=auth, timeout=120,
                          json={"model": model, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "ignore_eos": True})

    try:
        spec = {"model": {"source": "smollm2-135m", "servedName": "base"}, "resources": {"cpuOnly": True},
                "replicas": 1, "autoscaling": {"enabled": False}, "apiKeySecretRef": {"name": "engine-key", "key": "key"},
                "env": [{"name": "HF_ENDPOINT", "value": hub.url}], "engineSettings": {"kvCacheMemory": "32MiB", "maxModelLen": 256, "maxLoras": 2},
                "adapters": [{"name": "sql", "source": "hf://org/sql"}, {"name": "poet", "source": "hf://org/poet"}]}
        apply_isvc(cluster, namespace, "base", spec)
        wait_until(lambda: loaded({"sql": 1, "poet": 1}), timeout=180, what="both adapters loaded into the pod")
        assert condition(isvc(), "Degraded").get("status") == "False", condition(isvc(), "Degraded")
        table = api.get(f"{cluster.server}/apis/serving.kvpilot.dev/v1alpha1/namespaces/{namespace}/inferenceservices/base",
                        headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}).json()  # what kubectl get prints
        assert table["rows"][0]["cells"][[c["name"] for c in table["columnDefinitions"]].index("Adapters")] == 2, table
        [engine] = ready_endpoints(api, cluster.server, namespace, "base")
        models = httpx.get(f"{engine}/v1/models", headers=auth, timeout=10).json()["data"]
        assert {(m["id"], m["parent"], m["root"]) for m in models} == {("base", None, "base"), ("sql", "base", "hf://org/sql"),
                                                                       ("poet", "base", "hf://org/poet")}

        direct = {m: complete(engine, m) for m in ("base", "sql", "poet")}
        assert all(r.status_code == 200 for r in direct.values()), {m: r.text for m, r in direct.items()}
        texts = {m: r.json()["choices"][0]["text"] for m, r in direct.items()}
        assert len(set(texts.values())) == 3, texts  # each adapter changes the base model's output, differently
        wait_until(lambda: {"sql", "poet"} <= {m["id"] for m in httpx.get(f"{gateway.url}/v1/models", timeout=5).json()["data"]},
                   timeout=30, what="the gateway knows both adapters")
        for model in ("sql", "poet"):
            r = complete(gateway.url, model)
            assert r.status_code == 200 and r.json()["model"] == model and r.json()["choices"][0]["text"] == texts[model], r.text

        spec["replicas"] = 2
        apply_isvc(cluster, namespace, "base", spec)
        wait_until(lambda: loaded({"sql": 2, "poet": 2}), timeout=150, what="the new replica got both adapters")
        for endpoint in ready_endpoints(api, cluster.server, namespace, "base"):
            r = complete(endpoint, "poet")
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == texts["poet"], (endpoint, r.text)

        spec["adapters"] = spec["adapters"][:1]
        apply_isvc(cluster, namespace, "base", spec)
        wait_until(lambda: loaded({"sql": 2}), timeout=60, what="poet gone from the status")
        for endpoint in ready_endpoints(api, cluster.server, namespace, "base"):
            ids = {m["id"] for m in httpx.get(f"{endpoint}/v1/models", headers=auth, timeout=10).json()["data"]}
            assert ids == {"base", "sql"}, (endpoint, ids)
        wait_until(lambda: complete(gateway.url, "poet").status_code == 404, timeout=30, what="the gateway answers poet with 404")
        assert complete(gateway.url, "poet").json()["error"]["code"] == "model_not_found"
        assert {p.removeprefix("/org/sql/resolve/main/") for p in hub.downloads if p.startswith("/org/sql/")} == \
            {"adapter_config.json", "adapter_model.safetensors"}
    finally:
        gateway.stop()
        op.stop()
        runner.stop()
        hub.close()
