"""LoRA adapters into engine pods: spec.adapters made true on every Ready pod through the engine's own
run-time API (kvpilot's, and vLLM's: the same paths and bodies), without a restart.

What a pod holds is read from the pod itself (its /v1/models: adapters are the entries with a
`parent`, their `root` the path they were loaded from), so a restarted pod, a new replica or an
operator restart is re-synced by the next pass. A pass runs every SYNC_SECONDS and at once when a pod
turns Ready or the spec changes (`AdapterSync.poke`). Each pod's adapters are written on it as an
annotation (ADAPTERS_ANNOTATION), which kvpilot-gateway routes on; per adapter, how many Ready pods
hold it goes into the service's status (reconcile.write_status, the one status writer).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from dataclasses import dataclass, field

import httpx
from kubernetes.client.rest import ApiException

from kvpilot.operator.builders.engines import PORT, adapter_load_path
from kvpilot.operator.builders.manifests import is_reachable_and_ready, selector_labels, serving_pods
from kvpilot.operator.cache import CACHE, ISVC, POD
from kvpilot.operator.crd_types import ADAPTERS_ANNOTATION, AdapterStatus, InferenceServiceSpec
from kvpilot.operator.kube import Kube

log = logging.getLogger("kvpilot.operator")
ADAPTER_ENGINES = ("kvpilot", "vllm")       # engines with run-time adapter loading (SGLang: refused by the spec)
SYNC_SECONDS = 10.0
RETRY_SECONDS = 30.0                        # a failed load is tried again on that pod after this long
LOAD_TIMEOUT_SECONDS = 600.0                # a load may download the adapter first
SECRET_TTL_SECONDS = 60.0


def plan(held: dict[str, str], desired: dict[str, str]) -> tuple[list[str], list[str]]:
    """(unload, load): adapter names to unload — not in the spec, or loaded from another path — and to load."""
    unload = sorted(n for n, path in held.items() if desired.get(n) != path)
    load = sorted(n for n, path in desired.items() if held.get(n) != path)
    return unload, load


def _error_message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}: {r.text[:300]}"


@dataclass(slots=True)
class PodSync:
    held: dict[str, str]                                  # adapter name -> the path it was loaded from
    errors: dict[str, str] = field(default_factory=dict)  # adapter name -> why its load failed


def sync_pod(http: httpx.Client, base_url: str, headers: dict[str, str], desired: dict[str, str],
             skip: set[str] = frozenset()) -> PodSync:
    """Make one engine hold exactly `desired` (name -> lora_path); `skip`: names not to try loading now
    (failed recently). Raises httpx.HTTPError when the engine cannot be asked what it holds."""
    r = http.get(f"{base_url}/v1/models", headers=headers, timeout=10)
    r.raise_for_status()
    held = {m["id"]: str(m.get("root")) for m in r.json().get("data") or [] if isinstance(m, dict) and m.get("parent")}
    result = PodSync(dict(held))
    unload, load = plan(held, desired)
    for name in unload:
        r = http.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers, timeout=60)
        if r.status_code in (200, 404):
            result.held.pop(name, None)
        else:
            result.errors[name] = f"unloading: {_error_message(r)}"
    for name in load:
        if name in skip or name in result.held:  # still held (its unload failed): not loaded over
            continue
        r = http.post(f"{base_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": desired[name]}, headers=headers,
                      timeout=LOAD_TIMEOUT_SECONDS)
        if r.status_code == 200:
            result.held[name] = desired[name]
        else:
            result.errors[name] = _error_message(r)
    return result


@dataclass(slots=True)
class AdapterReport:
    """The adapter sync's part of one service's status, applied by reconcile.write_status."""

    desired: dict[str, str]                   # name -> source it was computed for
    adapters: list[AdapterStatus]
    ready: tuple[str, str, str]               # AdaptersReady: status, reason, message


def report(spec: InferenceServiceSpec, ready_pods: int, pods: dict[str, PodSync]) -> AdapterReport:
    statuses, failed = [], []
    for a in spec.adapters:
        holders = sum(1 for p in pods.values() if a.name in p.held and not p.errors.get(a.name))
        message = next((f"pod {pod}: {p.errors[a.name]}" for pod, p in sorted(pods.items()) if a.name in p.errors), None)
        statuses.append(AdapterStatus(name=a.name, source=a.source, loaded_pods=holders, message=message))
        if message:
            failed.append(f"{a.name}: {message}")
    if failed:
        ready = ("False", "AdapterLoadFailed", "; ".join(failed)[:1000])
    elif ready_pods == 0:
        ready = ("False", "NoReadyPods", "no Ready pod to load adapters into")
    elif all(s.loaded_pods >= ready_pods for s in statuses):
        ready = ("True", "Loaded", f"{len(statuses)} adapters on each of {ready_pods} Ready pods")
    else:
        ready = ("False", "Loading", ", ".join(f"{s.name} {s.loaded_pods}/{ready_pods}" for s in statuses))
    return AdapterReport({a.name: a.source for a in spec.adapters}, statuses, ready)


class AdapterSync:
    """One thread: each pass syncs every Ready pod of every InferenceService with adapters."""

    def __init__(self, kube: Kube, parse_spec, on_report) -> None:
        self.kube, self.parse_spec, self.on_report = kube, parse_spec, on_report
        self.stop = threading.Event()
        self._poke = threading.Event()
        self._retry_at: dict[tuple[str, str, str], float] = {}   # (pod uid, adapter, path) -> when a failed load may be tried again
        self._errors: dict[tuple[str, str], str] = {}              # (pod uid, adapter) -> the failure, while it stands
        self._secrets: dict[tuple[str, str, str], tuple[float, str]] = {}
        self.http = httpx.Client()

    def poke(self) -> None:
        self._poke.set()

    def run(self) -> None:
        while not self.stop.is_set():
            self._poke.wait(SYNC_SECONDS)
            self._poke.clear()
            if self.stop.is_set():
                return
            for body in CACHE.all(ISVC):
                if body["metadata"].get("deletionTimestamp"):
                    continue
                try:
                    self.sync_service(body)
                except Exception:  # noqa: BLE001 - one service must not stop the others
                    log.exception("adapter sync: %s/%s", body["metadata"]["namespace"], body["metadata"]["name"])
            live = {p["metadata"]["uid"] for p in CACHE.all(POD)}
            self._retry_at = {k: v for k, v in self._retry_at.items() if k[0] in live}
            self._errors = {k: v for k, v in self._errors.items() if k[0] in live}

    def sync_service(self, body: dict) -> None:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        spec, _ = self.parse_spec(body)
        if spec is None or spec.engine not in ADAPTER_ENGINES or not spec.adapters:
            return
        desired = {a.name: adapter_load_path(spec, a.source) for a in spec.adapters}
        try:
            headers = self._auth(namespace, spec)
        except (ApiException, KeyError, ValueError) as e:
            why = f"the API key Secret {spec.api_key_secret_ref.name!r} (key {spec.api_key_secret_ref.key!r}) cannot be read: {getattr(e, 'reason', None) or e!r}"
            self.on_report(namespace, name, AdapterReport({a.name: a.source for a in spec.adapters},
                                                          [AdapterStatus(name=a.name, source=a.source) for a in spec.adapters],
                                                          ("False", "ApiKeyUnreadable", why)))
            return
        now = time.monotonic()
        results: dict[str, PodSync] = {}
        ready_pods = [p for p in serving_pods(CACHE.with_labels(POD, namespace, selector_labels(name))) if is_reachable_and_ready(p)]  # (not a prefill pool's)
        for pod in ready_pods:
            uid, pod_name = pod["metadata"]["uid"], pod["metadata"]["name"]
            skip = {n for n, path in desired.items() if self._retry_at.get((uid, n, path), 0) > now}
            try:
                result = sync_pod(self.http, f"http://{pod['status']['podIP']}:{PORT}", headers, desired, skip)
            except (httpx.HTTPError, ValueError) as e:
                log.warning("adapter sync: pod %s/%s: %s", namespace, pod_name, e)
                continue  # not counted: it holds what it holds; the next pass asks again
            for n, why in result.errors.items():
                self._retry_at[(uid, n, desired.get(n, ""))] = now + RETRY_SECONDS
                self._errors[(uid, n)] = why
                log.warning("adapter %s on pod %s/%s: %s", n, namespace, pod_name, why)
            for n in result.held:
                if n not in result.errors:
                    self._errors.pop((uid, n), None)
            result.errors = {n: why for (u, n), why in self._errors.items() if u == uid and n in desired and n not in result.held}
            results[pod_name] = result
            self._annotate(pod, sorted(result.held))
        self.on_report(namespace, name, report(spec, len(ready_pods), results))

    def _annotate(self, pod: dict, held: list[str]) -> None:
        value = ",".join(held)
        if ((pod["metadata"].get("annotations") or {}).get(ADAPTERS_ANNOTATION) or "") != value:
            CACHE.put(POD, self.kube.annotate_pod(pod["metadata"]["name"], pod["metadata"]["namespace"], {ADAPTERS_ANNOTATION: value}))

    def _auth(self, namespace: str, spec: InferenceServiceSpec) -> dict[str, str]:
        """The service's API key (its Secret, read with the operator's `get secrets`), as the engine wants it."""
        ref = spec.api_key_secret_ref
        if ref is None:
            return {}
        key = (namespace, ref.name, ref.key)
        cached = self._secrets.get(key)
        if cached is None or time.monotonic() - cached[0] > SECRET_TTL_SECONDS:
            data = self.kube.secret_data(ref.name, namespace)
            cached = (time.monotonic(), base64.b64decode(data[ref.key]).decode().strip())
            self._secrets[key] = cached
        return {"Authorization": f"Bearer {cached[1]}"}
