"""Which pods serve which model: InferenceServices and their ready engine pods, read from the API
server (in-cluster service account, or $KUBECONFIG) and kept current by watches. A model's name is its
InferenceService's `model.servedName`, else the InferenceService's name — what clients put in
`model` — or the name of one of its `adapters`, routed to the pods that hold it. While the API server cannot be reached, the last table keeps serving.
A service at zero replicas is woken by annotating it (WAKE_ANNOTATION): the autoscaler scales it."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kvpilot.operator.builders.engines import PORT
from kvpilot.operator.builders.manifests import is_group_worker, is_reachable_and_ready
from kvpilot.operator.crd_types import ADAPTERS_ANNOTATION, GROUP, ISVC_LABEL, PLURAL, ROLE_LABEL, VERSION, WAKE_ANNOTATION

log = logging.getLogger("kvpilot.gateway")


WATCH_SECONDS = 240       # a watch is ended and the kind listed again this often (a resync)
WAKE_EVERY_SECONDS = 2.0  # a held request re-asks at most this often (the autoscaler may have missed one)


@dataclass(frozen=True)
class ModelRoute:
    namespace: str
    name: str                                       # the InferenceService
    endpoints: list[str] = field(default_factory=list)  # "podIP:port" of its Ready, not terminating pods (decode pods, when disaggregated)
    at_zero: bool = False                           # spec asks for 0 replicas (scaled to zero)
    prefill: list[str] = field(default_factory=list)  # its Ready prefill pods (ROLE_LABEL prefill): requests are prefilled there first


def endpoint_table(isvcs: list[dict], pods: list[dict]) -> dict[str, ModelRoute]:
    """served model name or adapter name -> its InferenceService and ready engine pods (for an adapter,
    those whose ADAPTERS_ANNOTATION lists it; all of them while none does: the engine then answers). A
    name served twice goes to the older InferenceService."""
    ready: dict[tuple[str, str], list[tuple[str, set[str]]]] = {}
    prefill: dict[tuple[str, str], list[str]] = {}
    for pod in pods:
        m, status = pod.get("metadata", {}), pod.get("status", {})
        owner = (m.get("labels") or {}).get(ISVC_LABEL)
        if owner and is_reachable_and_ready(pod) and not is_group_worker(pod):  # (no API there)
            endpoint = f"{status['podIP']}:{PORT}"
            if (m.get("labels") or {}).get(ROLE_LABEL) == "prefill":
                prefill.setdefault((m.get("namespace", ""), owner), []).append(endpoint)
                continue
            held = set(filter(None, ((m.get("annotations") or {}).get(ADAPTERS_ANNOTATION) or "").split(",")))
            ready.setdefault((m.get("namespace", ""), owner), []).append((endpoint, held))
    table: dict[str, ModelRoute] = {}
    by_age = sorted(isvcs, key=lambda o: ((o.get("metadata") or {}).get("creationTimestamp") or "", _key(o)))
    adapters = []
    for isvc in by_age:
        m, spec = isvc.get("metadata", {}), isvc.get("spec") or {}
        model = (spec.get("model") or {}).get("servedName") or m.get("name")
        if model in table:
            log.warning("model name %r is served by more than one InferenceService; routing to %s/%s", model, table[model].namespace, table[model].name)
            continue
        replicas = spec.get("replicas", spec.get("minReplicas", 1))
        pods_ = ready.get(_key(isvc), [])
        table[model] = ModelRoute(m.get("namespace", ""), m.get("name"), sorted(e for e, _ in pods_), at_zero=replicas == 0,
                                  prefill=sorted(prefill.get(_key(isvc), [])))
        adapters += [(a["name"], table[model], pods_) for a in spec.get("adapters") or [] if isinstance(a, dict) and a.get("name")]
    for name, route, pods_ in adapters:  # after every served name: an adapter never takes a model's name
        if name not in table:
            table[name] = ModelRoute(route.namespace, route.name, sorted(e for e, held in pods_ if name in held) or route.endpoints, route.at_zero)
            # (an adapter's requests are not disaggregated: the prefill pool does not load adapters)
    return table


def _key(obj: dict) -> tuple[str, str]:
    m = obj.get("metadata") or {}
    return m.get("namespace", ""), m.get("name", "")


class KubeEndpoints:
    """The endpoint table kept current by watches (one per kind and namespace, or cluster-wide): each
    lists, then watches from the list's resourceVersion; a watch that ends, expires (410) or fails lists
    again, so the table never misses a change for longer than one relist."""

    def __init__(self, namespaces: list[str], sync_timeout: float = 30.0):
        from kubernetes import client

        from kvpilot.operator.kube import load_config

        load_config()
        self.core, self.custom = client.CoreV1Api(), client.CustomObjectsApi()
        self._objects: dict[str, dict[tuple[str, str], dict]] = {"isvc": {}, "pod": {}}  # kind -> (namespace, name) -> object
        self._lock = threading.Lock()
        self._table: dict[str, ModelRoute] = {}
        self._woken: dict[str, float] = {}
        self._stop = threading.Event()
        streams = [(kind, ns) for kind in ("isvc", "pod") for ns in (namespaces or [None])]
        self._synced = {stream: threading.Event() for stream in streams}
        for kind, ns in streams:
            threading.Thread(target=self._watch, args=(kind, ns), name=f"kvpilot-gateway-watch-{kind}-{ns or 'all'}", daemon=True).start()
        for stream, synced in self._synced.items():
            if not synced.wait(sync_timeout):
                log.warning("the first list of %s did not come within %gs; routing with what is known", stream, sync_timeout)

    def _list_call(self, kind: str, namespace: str | None):
        if kind == "isvc":
            if namespace is None:
                return self.custom.list_cluster_custom_object, (GROUP, VERSION, PLURAL), {}
            return self.custom.list_namespaced_custom_object, (GROUP, VERSION, namespace, PLURAL), {}
        if namespace is None:
            return self.core.list_pod_for_all_namespaces, (), {"label_selector": ISVC_LABEL}
        return self.core.list_namespaced_pod, (namespace,), {"label_selector": ISVC_LABEL}

    def _watch(self, kind: str, namespace: str | None) -> None:
        from kubernetes import watch

        list_fn, args, kwargs = self._list_call(kind, namespace)
        while not self._stop.is_set():
            try:
                listed = json.loads(list_fn(*args, **kwargs, _preload_content=False).data)
                self._replace(kind, namespace, listed.get("items") or [])
                self._synced[(kind, namespace)].set()
                stream = watch.Watch().stream(list_fn, *args, **kwargs, resource_version=listed["metadata"]["resourceVersion"],
                                              timeout_seconds=WATCH_SECONDS)
                for event in stream:
                    if event["type"] == "ERROR":  # e.g. 410 Gone: the resourceVersion is too old; list again
                        break
                    self._apply(kind, event["type"], event["raw_object"])
                    if self._stop.is_set():
                        return
            except Exception as e:  # noqa: BLE001 - the API server blinked: keep routing on the last table, list again
                log.warning("watching %s failed (%s: %s); listing again in 1s", kind, type(e).__name__, e)
                self._stop.wait(1.0)

    def _replace(self, kind: str, namespace: str | None, items: list[dict]) -> None:
        with self._lock:
            objects = self._objects[kind]
            for key in [k for k in objects if namespace is None or k[0] == namespace]:
                del objects[key]
            objects.update((_key(o), o) for o in items)
            self._rebuild()

    def _apply(self, kind: str, event: str, obj: dict) -> None:
        with self._lock:
            if event == "DELETED":
                self._objects[kind].pop(_key(obj), None)
            elif event in ("ADDED", "MODIFIED"):
                self._objects[kind][_key(obj)] = obj
            else:  # BOOKMARK: nothing changed
                return
            self._rebuild()

    def _rebuild(self) -> None:
        self._table = endpoint_table(list(self._objects["isvc"].values()), list(self._objects["pod"].values()))

    def endpoints(self, model: str) -> list[str] | None:
        route = self._table.get(model)
        return None if route is None else route.endpoints

    def prefill_endpoints(self, model: str) -> list[str]:
        route = self._table.get(model)
        return [] if route is None else route.prefill

    def wake(self, model: str) -> None:
        """Ask for a pod of a service scaled to zero (blocking: call it off the event loop)."""
        route = self._table.get(model)
        if route is None or not route.at_zero or time.monotonic() - self._woken.get(model, -1e9) < WAKE_EVERY_SECONDS:
            return
        self._woken[model] = time.monotonic()
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            self.custom.patch_namespaced_custom_object(GROUP, VERSION, route.namespace, PLURAL, route.name,
                                                       {"metadata": {"annotations": {WAKE_ANNOTATION: stamp}}})
            log.info("asked to scale %s/%s up from zero (a request for %r is waiting)", route.namespace, route.name, model)
        except Exception as e:  # noqa: BLE001 - the held request retries in WAKE_EVERY_SECONDS
            log.warning("could not ask %s/%s to scale up from zero: %s", route.namespace, route.name, e)

    def models(self) -> list[str]:
        return sorted(self._table)

    def stop(self) -> None:
        self._stop.set()
