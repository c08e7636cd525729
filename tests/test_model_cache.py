"""The model cache's pure parts: the spec with the operator's defaults, the Deployment's volumes and
arguments, the entry's claim (merged owners, immutable spec kept), its loader Job, the entry's state
from the claim and the loader pods; the cold-start arithmetic. The control-plane side is
e2e/test_model_cache.py's."""

from __future__ import annotations

import json

import pytest

from kvpilot.operator.builders import model_cache as mc
from kvpilot.operator.builders.manifests import deployment
from kvpilot.operator.cold_start import cold_start
from kvpilot.operator.crd_types import InferenceServiceSpec

HF = "hf://org/repo/model.Q4_0.gguf"
OPERATOR_DEFAULTS = mc.CacheDefaults()


def spec(source: str = HF, cache: dict | None = None, defaults: mc.CacheDefaults = OPERATOR_DEFAULTS, **kw) -> InferenceServiceSpec:
    body = {"model": {"source": source, **({"cache": cache} if cache else {})}, **kw}
    return mc.with_defaults(InferenceServiceSpec.model_validate(body), defaults)


def pod_spec(s: InferenceServiceSpec) -> dict:
    return deployment("svc", "ns", "uid-1", s)["spec"]["template"]["spec"]


def test_defaults_fill_what_the_spec_leaves_unset():
    shared = mc.CacheDefaults(mode="Shared", storage_class_name="rwx", size="50Gi")
    assert spec(defaults=shared).model.cache.model_dump() == {"mode": "Shared", "storage_class_name": "rwx", "size": "50Gi"}
    own = spec(cache={"mode": "PerPod"}, defaults=shared).model.cache
    assert (own.mode, own.storage_class_name, own.size) == ("PerPod", "rwx", "50Gi")
    assert spec().model.cache.mode == "PerPod"  # the operator's own default: today's per-pod download


def test_shared_pods_mount_the_entry_read_only_and_download_nothing():
    s = spec(cache={"mode": "Shared"}, engineSettings={"speculative": {"method": "draft", "draftModel": "https://example.com/d/draft.gguf"}})
    p = pod_spec(s)
    volumes = {v["name"]: v for v in p["volumes"]}
    assert volumes["model"] == {"name": "model", "persistentVolumeClaim": {"claimName": mc.claim_name(HF), "readOnly": True}}
    assert volumes["draft-model"]["persistentVolumeClaim"]["claimName"] == mc.claim_name("https://example.com/d/draft.gguf")
    assert volumes["compile-cache"] == {"name": "compile-cache", "persistentVolumeClaim": {"claimName": mc.COMPILE_CACHE_CLAIM}}
    assert "initContainers" not in p
    c = p["containers"][0]
    assert {"name": "model", "mountPath": "/models/cache", "readOnly": True} in c["volumeMounts"]
    assert {"name": "compile-cache", "mountPath": mc.COMPILE_CACHE_DIR} in c["volumeMounts"]
    assert c["args"][c["args"].index("--model") + 1] == "/models/cache/model.Q4_0.gguf"
    assert c["args"][c["args"].index("--speculative-model") + 1] == "/models/draft/cache/draft.gguf"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TRITON_CACHE_DIR"] == f"{mc.COMPILE_CACHE_DIR}/triton" and env["TORCHINDUCTOR_CACHE_DIR"] == f"{mc.COMPILE_CACHE_DIR}/inductor"
    assert [e["name"] for e in c["env"]].count("TRITON_CACHE_DIR") == 1


def test_per_pod_and_sources_without_a_download_keep_their_volumes():
    per_pod = pod_spec(spec(cache={"mode": "PerPod"}))
    assert [i["name"] for i in per_pod["initContainers"]] == ["download-model"]
    assert {v["name"]: v for v in per_pod["volumes"]}["model"] == {"name": "model", "emptyDir": {}}
    for source in ("smollm2-135m", "pvc://claim/m.gguf"):  # in the image / already on a claim: nothing to cache
        s = spec(source, cache={"mode": "Shared"})
        assert mc.cached_files(s) == [] and all("kvpilot-model-" not in json.dumps(v) for v in pod_spec(s)["volumes"])
    vllm = spec("hf://org/repo", cache={"mode": "Shared"}, engine="vllm", resources={"cpuOnly": False})
    c = pod_spec(vllm)["containers"][0]  # vLLM would fetch the hub repo itself; with the cache it reads the filled directory
    assert "/models/cache/repo" in c["args"] and [f.source for f in mc.cached_files(vllm)] == ["hf://org/repo"]


def test_a_model_whose_weights_the_engine_makes_downloads_its_config_per_pod_and_fills_no_entry(capsys):
    """--load-format dummy (a capacity test): the engine reads the checkpoint's config and tokenizer only, so each pod
    fetches those (--config-only) and no cache entry is filled with weights nobody reads; a draft model is still loaded."""
    draft = {"speculative": {"method": "draft", "draftModel": "hf://org/draft"}}
    for dummy in (["--load-format", "dummy"], ["--load-format=dummy"], ["--load-form", "dummy"]):  # (as `kvpilot serve` reads them)
        s = spec("hf://org/repo", cache={"mode": "Shared"}, extraArgs=dummy, engineSettings=draft)
        inits = {i["name"]: i for i in pod_spec(s)["initContainers"]}
        assert inits["download-model"]["args"][:2] == ["hf://org/repo", "/models/download/repo"], dummy
        assert "--config-only" in inits["download-model"]["args"], dummy
        assert [f.source for f in mc.cached_files(s)] == ["hf://org/draft"] and "download-draft-model" not in inits
        c = pod_spec(s)["containers"][0]
        assert c["args"][c["args"].index("--model") + 1] == "/models/download/repo" and "dummy" in " ".join(c["args"])
    for s in (spec("hf://org/repo", extraArgs=["--load-format", "auto"]), spec("hf://org/repo/model.Q4_0.gguf", extraArgs=["--load-format", "dummy"])):
        (init,) = pod_spec(s)["initContainers"]  # real weights, or one file: the whole download
        assert "--config-only" not in init["args"]
    # a value the engine refuses (its own error, at start, says it): the whole download, and no usage in the operator's log
    assert [f.source for f in mc.cached_files(spec("hf://org/repo", cache={"mode": "Shared"}, extraArgs=["--load-format", "bogus"]))] == ["hf://org/repo"]
    assert capsys.readouterr().err == ""
    vllm = spec("hf://org/repo", cache={"mode": "Shared"}, engine="vllm", resources={"cpuOnly": False}, extraArgs=["--load-format", "dummy"])
    assert [f.source for f in mc.cached_files(vllm)] == ["hf://org/repo"]  # vLLM's own flag: the operator reads kvpilot's alone


def test_entry_names_are_per_source():
    assert mc.claim_name(HF) == mc.claim_name(HF) != mc.claim_name(HF + "x")
    assert len(mc.claim_name(HF)) <= 63


def test_the_entry_claim_keeps_an_existing_spec_and_names_only_its_user():
    s = spec(cache={"mode": "Shared", "size": "30Gi", "storageClassName": "fast"})
    new = mc.entry_claim(HF, "ns", s, ("svc", "uid-1"), None)
    assert new["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "30Gi"}}, "storageClassName": "fast"}
    assert new["metadata"]["ownerReferences"] == [{"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService", "name": "svc",
                                                   "uid": "uid-1", "blockOwnerDeletion": False}]
    assert new["metadata"]["labels"][mc.ENTRY_LABEL] == mc.entry_key(HF) and new["metadata"]["annotations"] == {mc.SOURCE_ANNOTATION: HF}
    existing = {"spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}, "storageClassName": "slow",
                         "volumeName": "pv-1", "volumeMode": "Filesystem"}}
    other = mc.entry_claim(HF, "ns", spec(cache={"mode": "Shared", "size": "99Gi"}), ("other", "uid-2"), existing)
    assert other["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}, "storageClassName": "slow"}
    released = mc.entry_claim(HF, "ns", s, None, existing)
    assert "ownerReferences" not in released["metadata"] and released["spec"] == other["spec"]
    assert mc.user_field_manager("uid-1") != mc.user_field_manager("uid-2")


def test_the_loader_job():
    s = spec(cache={"mode": "Shared"}, env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}])
    claim = {"metadata": {"name": mc.claim_name(HF), "uid": "claim-uid"}}
    job = mc.fill_job(mc.cached_files(s)[0], "ns", s, claim, [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}])
    assert job["metadata"]["ownerReferences"][0] == {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "name": mc.claim_name(HF),
                                                     "uid": "claim-uid", "controller": True, "blockOwnerDeletion": True}
    assert job["spec"]["backoffLimit"] == mc.FILL_BACKOFF_LIMIT and job["spec"]["ttlSecondsAfterFinished"] == mc.FILL_JOB_TTL_SECONDS
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["kvpilot", "fetch-model"] and c["args"][:2] == [HF, "/entry/model.Q4_0.gguf"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in c["env"]
    assert pod["restartPolicy"] == "Never" and pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert {"name": "entry", "persistentVolumeClaim": {"claimName": mc.claim_name(HF)}} in pod["volumes"]
    assert job["spec"]["template"]["metadata"]["labels"][mc.ENTRY_LABEL] == mc.entry_key(HF)


def loader(created: str, phase: str, message: str = "") -> dict:
    status = {"phase": phase}
    if message:
        status["containerStatuses"] = [{"name": "fill", "state": {"terminated": {"exitCode": 1, "message": message}}}]
    return {"metadata": {"creationTimestamp": created}, "status": status}


def test_entry_state_from_the_claim_and_its_loaders():
    summary = json.dumps({"revision": "abc123", "bytes": 98362432})
    annotations = mc.filled_annotations(summary, "2026-11-25T10:00:00Z")
    assert annotations == {mc.REVISION_ANNOTATION: "abc123", mc.BYTES_ANNOTATION: "98362432", mc.FILLED_ANNOTATION: "2026-11-25T10:00:00Z"}
    assert mc.filled_annotations("kvpilot: fetch failed: HTTP 404", "t") is None and mc.filled_annotations('{"bytes": "x"}', "t") is None
    assert mc.entry_state({"metadata": {"annotations": annotations}}, []) == ("Ready", "abc123", 98362432, None)
    claim = {"metadata": {"annotations": {}}}
    assert mc.entry_state(claim, []) == ("Filling", None, None, None)
    failed = loader("2026-11-25T10:00:00Z", "Failed", "kvpilot: fetch failed: HTTP 404 Not Found")
    assert mc.entry_state(claim, [failed]) == ("Failed", None, None, "kvpilot: fetch failed: HTTP 404 Not Found")
    assert mc.entry_state(claim, [failed, loader("2026-11-25T10:00:20Z", "Pending")])[0] == "Filling"  # the Job's retry runs
    assert mc.entry_state(claim, [loader("2026-11-25T10:00:00Z", "Failed")])[3] == "the loader failed (no message)"


def engine_pod(created="2026-11-25T10:00:00Z", scheduled="2026-11-25T10:00:01Z", ready="2026-11-25T10:00:20Z", started=None) -> dict:
    conditions = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled}]
    if ready:
        conditions.append({"type": "Ready", "status": "True", "lastTransitionTime": ready})
    statuses = [{"name": "engine", "state": {"running": {"startedAt": started}}}] if started else []
    return {"metadata": {"name": "svc-abc", "creationTimestamp": created}, "status": {"conditions": conditions, "containerStatuses": statuses}}


def test_cold_start_phases_from_the_pod_and_the_engine():
    from datetime import datetime

    process_start = datetime.fromisoformat("2026-11-25T10:00:06+00:00").timestamp()
    phases = {"import": 4.0, "load": 6.5, "warmup": 2.0, "listen": 0.5}
    c = cold_start(engine_pod(), process_start, phases)
    assert c.pod == "svc-abc" and c.ready_time == "2026-11-25T10:00:20Z" and c.total_seconds == 20.0
    assert [(p.name, p.seconds) for p in c.phases] == [("scheduling", 1.0), ("model", 5.0), ("import", 4.0), ("load", 6.5), ("warmup", 2.0),
                                                       ("listen", 0.5), ("ready", 1.0)]
    # another engine (no start-up metrics): the container's start splits the rest
    other = cold_start(engine_pod(started="2026-11-25T10:00:03Z"), None, {})
    assert [(p.name, p.seconds) for p in other.phases] == [("scheduling", 1.0), ("model", 2.0), ("ready", 17.0)]
    assert cold_start(engine_pod(ready=None), process_start, phases) is None
    # whole-second timestamps: a phase that rounds below zero reads 0, never negative
    early = cold_start(engine_pod(ready="2026-11-25T10:00:18Z"), process_start, phases)
    assert {p.name: p.seconds for p in early.phases}["ready"] == 0.0


@pytest.mark.parametrize("bad", [{"model": {"source": HF, "cache": {"mode": "Always"}}}, {"model": {"source": HF, "cache": {"size": "lots"}}},
                                 {"model": {"source": HF, "cache": {"storageClassName": "Bad_Name"}}}])
def test_bad_cache_settings_are_refused(bad):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        InferenceServiceSpec.model_validate(bad)
