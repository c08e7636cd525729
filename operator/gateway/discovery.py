"""Which pods serve which model: InferenceServices and their ready engine pods, read from the API
server (in-cluster service account, or $KUBECONFIG), refreshed every `interval` seconds in a
background thread. A model's name is its InferenceService's `model.servedName`, else the
InferenceService's name — what clients put in `model`. A failed refresh keeps the last table.
A service at zero replicas is woken by annotating it (WAKE_ANNOTATION): the autoscaler scales it."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kvpilot.operator.builders.engines import PORT
from kvpilot.operator.crd_types import GROUP, ISVC_LABEL, PLURAL, VERSION, WAKE_ANNOTATION

log = logging.getLogger("kvpilot.gateway")


WAKE_EVERY_SECONDS = 2.0  # a held request re-asks at most this often (the autoscaler may have missed one)


@dataclass(frozen=True)
class ModelRoute:
    namespace: str
    name: str                                       # the InferenceService
    endpoints: list[str] = field(default_factory=list)  # "podIP:port" of its Ready, not terminating pods
    at_zero: bool = False                           # spec asks for 0 replicas (scaled to zero)


def endpoint_table(isvcs: list[dict], pods: list[dict]) -> dict[str, ModelRoute]:
    """served model name -> its InferenceService and ready engine pods."""
    ready: dict[tuple[str, str], list[str]] = {}
    for pod in pods:
        m, status = pod.get("metadata", {}), pod.get("status", {})
        owner = (m.get("labels") or {}).get(ISVC_LABEL)
        is_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        if owner and is_ready and status.get("podIP") and not m.get("deletionTimestamp"):
            ready.setdefault((m.get("namespace", ""), owner), []).append(f"{status['podIP']}:{PORT}")
    table: dict[str, ModelRoute] = {}
    for isvc in isvcs:
        m, spec = isvc.get("metadata", {}), isvc.get("spec") or {}
        model = (spec.get("model") or {}).get("servedName") or m.get("name")
        if model in table:
            log.warning("model name %r is served by more than one InferenceService; routing to %s/%s", model, m.get("namespace"), m.get("name"))
        replicas = spec.get("replicas", spec.get("minReplicas", 1))
        table[model] = ModelRoute(m.get("namespace", ""), m.get("name"), sorted(ready.get((m.get("namespace", ""), m.get("name")), [])),
                                  at_zero=replicas == 0)
    return table


class KubeEndpoints:
    def __init__(self, namespaces: list[str], interval: float = 1.0):
        from kubernetes import client

        from kvpilot.operator.kube import load_config

        load_config()
        self.core, self.custom = client.CoreV1Api(), client.CustomObjectsApi()
        self.namespaces, self.interval = namespaces, interval
        self._table: dict[str, ModelRoute] = {}
        self._woken: dict[str, float] = {}
        self._stop = threading.Event()
        self.refresh()
        threading.Thread(target=self._loop, name="kvpilot-gateway-discovery", daemon=True).start()

    def refresh(self) -> None:
        isvcs, pods = [], []
        for ns in self.namespaces or [None]:
            if ns is None:
                isvcs += self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
                pods += self.core.list_pod_for_all_namespaces(label_selector=ISVC_LABEL).to_dict()["items"]
            else:
                isvcs += self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
                pods += self.core.list_namespaced_pod(ns, label_selector=ISVC_LABEL).to_dict()["items"]
        self._table = endpoint_table(isvcs, [_camel_status(p) for p in pods])

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - the API server blinked: keep routing on the last table
                log.warning("refreshing the endpoint table failed (%s: %s); keeping the last one", type(e).__name__, e)

    def endpoints(self, model: str) -> list[str] | None:
        route = self._table.get(model)
        return None if route is None else route.endpoints

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


def _camel_status(pod: dict) -> dict:
    """The kubernetes client's to_dict() spells fields in snake_case: back to the API's names we read."""
    m, s = pod.get("metadata") or {}, pod.get("status") or {}
    return {"metadata": {"name": m.get("name"), "namespace": m.get("namespace"), "labels": m.get("labels"),
                         "deletionTimestamp": m.get("deletion_timestamp")},
            "status": {"podIP": s.get("pod_ip"), "conditions": s.get("conditions") or []}}
