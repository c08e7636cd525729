"""The model cache on the local control plane (#41): an InferenceService with spec.model.cache.mode Shared
and an hf:// GGUF source (a loopback hub serving the bundled model's file, X-Repo-Commit included) gets a
ReadWriteMany claim (bound by the controller-manager to a pre-made host-directory PersistentVolume) and
a loader Job that fills it once; scaled 0 -> 1 -> 3, every pod mounts the claim and the hub served the
file exactly once. A second service of the same source reuses the entry; deleting one keeps it; the
other's source change fills a new entry and frees the old (the garbage collector, by ownerReferences);
deleting it frees the new one. A bad source is a condition + Event, and no
engine pod is started. Time from replicas 0 -> 1 to a first token is printed with and without the cache."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from e2e.cluster import TOKEN, _insecure
from e2e.hub import COMMIT, LoopbackHub, smol_hub
from e2e.isvc import apply_isvc, condition, get_isvc
from e2e.load import ready_endpoints
from e2e.net import free_port
from e2e.operator_proc import OperatorProcess
from e2e.pod_runner import PodRunner
from e2e.waiting import wait_until
from kvpilot.operator.builders.model_cache import claim_name
from kvpilot.server.model_files import resolve_model_path

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]
SOURCE = "hf://org/smol/smol.gguf"  # what smol_hub serves


def spec(source: str, replicas: int, hub: LoopbackHub, cache: dict | None) -> dict:
    return {"model": {"source": source, "servedName": "smol", **({"cache": cache} if cache else {})}, "replicas": replicas, "minReplicas": 0, "maxReplicas": 3,
            "autoscaling": {"enabled": False}, "resources": {"cpuOnly": True}, "env": [{"name": "HF_ENDPOINT", "value": hub.url}],
            "engineSettings": {"kvCacheMemory": "16MiB", "maxModelLen": 256}}


def first_token_after_scale_up(cluster, namespace: str, name: str, body: dict, api: httpx.Client) -> float:
    """Seconds from replicas 0 -> 1 to the first completion answered by the new pod."""
    start = time.monotonic()
    apply_isvc(cluster, namespace, name, {**body, "replicas": 1})

    def answered():
        for endpoint in ready_endpoints(api, cluster.server, namespace, name):
            r = httpx.post(f"{endpoint}/v1/completions", timeout=30, json={"model": "smol", "prompt": "Hi", "max_tokens": 1})
            return r.status_code == 200
        return False

    wait_until(answered, timeout=120, interval=0.2, what=f"{name}: a first token after 0 -> 1")
    return time.monotonic() - start


def cold_start(cluster, namespace: str, name: str) -> dict:
    """The service's lastColdStart, once the operator has measured its pod."""
    started = wait_until(lambda: ((get_isvc(cluster, namespace, name) or {}).get("status") or {}).get("lastColdStart"), timeout=30,
                         what=f"{name}: the cold start in the status")
    phases = {p["name"]: p["seconds"] for p in started["phases"]}
    assert list(phases) == ["scheduling", "model", "import", "load", "warmup", "listen", "ready"], started
    # whole-second pod timestamps: the phases add up to the total within that resolution
    assert abs(sum(phases.values()) - started["totalSeconds"]) <= 2.0, started
    assert phases["load"] > 0 and phases["import"] > 0, started
    return started


def phase_line(started: dict) -> str:
    return ", ".join(f"{p['name']} {p['seconds']:.1f}" for p in started["phases"]) + f"; total {started['totalSeconds']:.1f} s"


def claim(cluster, namespace: str, name: str) -> dict | None:
    r = cluster.kubectl("get", "pvc", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


@pytest.mark.timeout(420)
def test_shared_cache_fills_once_serves_every_pod_and_is_freed_with_its_last_user(cluster, namespace, tmp_path):
    cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    cluster.add_host_volumes(6, tmp_path / "volumes", prefix=f"mc-{namespace}")  # Retain: a released one is not bound again
    hub = smol_hub(resolve_model_path("smollm2-135m"))
    runner = PodRunner(cluster.server, tmp_path / "pods").start()
    operator_metrics = f"127.0.0.1:{free_port()}"
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", args=["--liveness", operator_metrics])
    api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    cache = {"mode": "Shared", "storageClassName": "kvpilot-local", "size": "1Gi"}
    entry = claim_name(SOURCE)
    try:
        # Uncached, for comparison: each pod downloads into its own emptyDir.
        uncached = spec(SOURCE, 0, hub, {"mode": "PerPod"})
        apply_isvc(cluster, namespace, "plain", uncached)
        wait_until(lambda: get_isvc(cluster, namespace, "plain") and condition(get_isvc(cluster, namespace, "plain"), "Ready").get("reason") == "ScaledToZero",
                   timeout=60, what="plain at 0 replicas")
        plain_seconds = first_token_after_scale_up(cluster, namespace, "plain", uncached, api)
        assert len(hub.downloads) == 1
        plain_start = cold_start(cluster, namespace, "plain")
        cluster.kubectl("delete", "kvis", "plain", "-n", namespace, "--wait=true")

        # Shared: the entry is filled while the service is at 0 replicas.
        first = spec(SOURCE, 0, hub, cache)
        apply_isvc(cluster, namespace, "first", first)

        def entry_status(name):
            return ((get_isvc(cluster, namespace, name) or {}).get("status") or {}).get("modelCache") or [{}]

        wait_until(lambda: entry_status("first")[0].get("state") == "Ready", timeout=120, what="the cache entry filled")
        [status] = entry_status("first")
        size = resolve_model_path("smollm2-135m").stat().st_size
        assert status == {"claim": entry, "source": SOURCE, "state": "Ready", "revision": COMMIT, "bytes": size}, status
        assert len(hub.downloads) == 2  # the uncached pod's, then the loader's
        cached_seconds = first_token_after_scale_up(cluster, namespace, "first", first, api)
        cached_start = cold_start(cluster, namespace, "first")
        apply_isvc(cluster, namespace, "first", {**first, "replicas": 3})
        wait_until(lambda: len(ready_endpoints(api, cluster.server, namespace, "first")) == 3, timeout=180, what="3 cached replicas Ready")
        pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", "serving.kvpilot.dev/inferenceservice=first", "-o", "json").stdout)["items"]
        for pod in pods:
            volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
            assert volumes["model"]["persistentVolumeClaim"] == {"claimName": entry, "readOnly": True}
            assert not pod["spec"].get("initContainers")  # no download of their own
        for endpoint in ready_endpoints(api, cluster.server, namespace, "first"):
            r = httpx.post(f"{endpoint}/v1/completions", timeout=60, json={"model": "smol", "prompt": "The capital of France is", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert len(hub.downloads) == 2  # three pods, one fill
        print(f"\nreplicas 0 -> 1 to a first token: {plain_seconds:.1f} s downloading in the pod, {cached_seconds:.1f} s from the cache\n"
              f"cold start, downloading: {phase_line(plain_start)}\ncold start, from the cache: {phase_line(cached_start)}")
        histogram = httpx.get(f"http://{operator_metrics}/metrics").text
        for phase in ("model", "load", "total"):  # the three first-wave pods and the uncached one
            assert f'kvpilot_operator_cold_start_seconds_count{{phase="{phase}"}} 4.0' in histogram, histogram

        # A second service of the same source: the same entry, Ready at once, no download.
        apply_isvc(cluster, namespace, "second", spec(SOURCE, 0, hub, cache))
        wait_until(lambda: entry_status("second")[0].get("state") == "Ready", timeout=60, what="the second service sees the entry")
        assert len(hub.downloads) == 2
        owners = lambda: sorted(o["name"] for o in (claim(cluster, namespace, entry) or {}).get("metadata", {}).get("ownerReferences") or [])  # noqa: E731
        wait_until(lambda: owners() == ["first", "second"], timeout=30, what="both services own the entry")
        cluster.kubectl("delete", "kvis", "first", "-n", namespace, "--wait=true")
        wait_until(lambda: owners() == ["second"], timeout=60, what="the first owner gone from the entry")
        assert claim(cluster, namespace, entry)["metadata"].get("deletionTimestamp") is None
        # A source change: a new entry is filled; the old one, let go of by its last user, is freed
        # (once its loader's Job, a user of the claim while it exists, has gone: 15 s after it ended).
        copy = "hf://org/smol/copy.gguf"
        apply_isvc(cluster, namespace, "second", spec(copy, 0, hub, cache))
        wait_until(lambda: entry_status("second")[0].get("claim") == claim_name(copy) and entry_status("second")[0].get("state") == "Ready",
                   timeout=90, what="the new source's entry filled")
        assert len(hub.downloads) == 3
        wait_until(lambda: claim(cluster, namespace, entry) is None, timeout=60, what="the old entry freed with its last user")
        cluster.kubectl("delete", "kvis", "second", "-n", namespace, "--wait=true")
        wait_until(lambda: claim(cluster, namespace, claim_name(copy)) is None, timeout=60, what="the new entry freed with its last user")

        # A bad source: a condition and an Event with the loader's own words; no engine pod.
        apply_isvc(cluster, namespace, "bad", spec("hf://org/missing/x.gguf", 1, hub, cache))
        wait_until(lambda: condition(get_isvc(cluster, namespace, "bad"), "Degraded").get("reason") == "ModelCacheFillFailed", timeout=90,
                   what="a failed fill in the status")
        message = condition(get_isvc(cluster, namespace, "bad"), "Degraded")["message"]
        assert "HTTP 404" in message, message
        events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=bad", "-o", "json").stdout)["items"]
        assert any(e["reason"] == "ModelCacheFillFailed" and "HTTP 404" in e["message"] for e in events), events
        assert cluster.kubectl("get", "deployment", "bad", "-n", namespace, check=False).returncode != 0  # no pods to crash-loop
        assert "Traceback" not in op.log()
    finally:
        op.stop()
        runner.stop()
        hub.close()
