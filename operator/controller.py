"""kopf handlers: thin wrappers that call reconcile() for the InferenceService concerned."""

from __future__ import annotations

import logging
import os
import threading
import time

import kopf

from kvpilot.operator import metrics
from kvpilot.operator.adapter_sync import AdapterSync
from kvpilot.operator.autoscaler.loop import AutoscalerState, evaluate
from kvpilot.operator.autoscaler.promql import PrometheusSource
from kvpilot.operator.builders.manifests import LWS_API
from kvpilot.operator.builders.model_cache import ENTRY_LABEL
from kvpilot.operator.cache import CACHE, CLAIM, DEPLOYMENT, ISVC, LOADER, LWS, POD
from kvpilot.operator.crd_types import GROUP, ISVC_LABEL, KIND, MANAGED_BY, PLURAL, VERSION
from kvpilot.operator.kube import Kube
from kvpilot.operator.reconcile import (
    entry_users,
    forget,
    forget_pod,
    is_own_write,
    parse_spec,
    reconcile,
    record_adapter_report,
    record_cold_start,
    record_fill,
    refresh_status,
    retry_if_waiting,
)

log = logging.getLogger("kvpilot.operator")
_kube: Kube | None = None


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube()
    return _kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    # kopf's own bookkeeping goes to annotations: a structural schema prunes unknown status fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.serving.kvpilot.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kopf.serving.kvpilot.dev", key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    # A watch stream that ends is followed by a full listing (kopf relists): ten minutes between them.
    settings.watching.server_timeout = 600
    settings.execution.max_workers = 8


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def on_inference_service(body, **_) -> None:
    reconcile(kube(), dict(body))
    if _adapters is not None:
        _adapters.poke()


def _cached(kind: str, event_type: str | None, body) -> bool:
    """Put a watched object into the cache (or drop it); True when it changed (a relist's unchanged
    objects are not news)."""
    meta = body["metadata"]
    if event_type == "DELETED":
        CACHE.delete(kind, meta.get("namespace", ""), meta["name"])
        return True
    return CACHE.put(kind, dict(body))


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_inference_service_event(type, body, meta, namespace, **_) -> None:  # noqa: A002 - kopf's keyword
    if _cached(ISVC, type, body) and type == "DELETED":
        forget(namespace, meta["name"])


@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY[0]: MANAGED_BY[1]})
def on_deployment(type, body, meta, namespace, **_) -> None:  # noqa: A002
    """Drift (a hand edit, a deletion) is undone; status changes refresh ours (an apply for each of
    them would be two requests per pod that turns Ready, per service)."""
    _on_workload(DEPLOYMENT, type, body, meta, namespace)


@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels={MANAGED_BY[0]: MANAGED_BY[1]})
def on_leader_worker_set(type, body, meta, namespace, **_) -> None:  # noqa: A002
    """The same for a service whose replicas are groups of pods (watched once LeaderWorkerSet's CRD is served)."""
    _on_workload(LWS, type, body, meta, namespace)


def _on_workload(kind: str, type, body, meta, namespace) -> None:  # noqa: A002
    before = CACHE.get(kind, namespace, meta["name"])
    if not _cached(kind, type, body) or not (owner := meta.get("labels", {}).get(ISVC_LABEL)):
        return
    if type != "DELETED" and before is not None and _same_but_status(before["metadata"], dict(body)["metadata"]):
        refresh_status(kube(), namespace, owner)
    else:
        log.info("%s %s/%s %s: reconciling %s", body.get("kind"), namespace, meta["name"], (type or "listed").lower(), owner)
        _reconcile_owner(namespace, owner)


def _same_but_status(old: dict, new: dict) -> bool:
    """Whether only a workload's status changed: its spec's generation, labels and annotations are as they were."""
    return all(old.get(k) == new.get(k) for k in ("generation", "labels", "annotations"))


@kopf.on.event("", "v1", "services", labels={MANAGED_BY[0]: MANAGED_BY[1]})
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels={MANAGED_BY[0]: MANAGED_BY[1]})
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels={MANAGED_BY[0]: MANAGED_BY[1]})
def on_owned_object(type, body, namespace, meta, **_) -> None:  # noqa: A002
    """A deletion or an edit is undone; the echo of our own apply (the resourceVersion it returned) and
    a relist's objects (type None) are not news."""
    owner = meta.get("labels", {}).get(ISVC_LABEL)
    if type is None or (type != "DELETED" and owner and is_own_write(namespace, owner, dict(body))):
        return
    log.info("%s %s/%s %s: reconciling %s", body.get("kind"), namespace, meta["name"], type.lower(), owner)
    _reconcile_owner(namespace, owner)


def _reconcile_owner(namespace: str, name: str | None) -> None:
    if not name:
        return
    body = CACHE.get(ISVC, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    reconcile(kube(), body)


@kopf.on.event("", "v1", "pods", labels={ISVC_LABEL: kopf.PRESENT})
def on_engine_pod(type, body, meta, namespace, **_) -> None:  # noqa: A002
    """A pod came, went or changed: status only (the Deployment owns pods: nothing to apply). A pod
    that just turned Ready has its cold start measured."""
    if _cached(POD, type, body) and (name := meta.get("labels", {}).get(ISVC_LABEL)):
        if type == "DELETED":
            forget_pod(meta["uid"])
        else:
            record_cold_start(namespace, name, dict(body))
        refresh_status(kube(), namespace, name)
        if _adapters is not None:  # a pod that turned Ready gets the service's adapters now, not at the next pass
            _adapters.poke()


@kopf.on.event("", "v1", "persistentvolumeclaims", labels={MANAGED_BY[0]: MANAGED_BY[1]})
def on_cache_claim(type, body, meta, namespace, **_) -> None:  # noqa: A002
    """A model cache entry changed (filled: its users' Deployments can be applied; deleted: made again)."""
    if _cached(CLAIM, type, body) and (key := meta.get("labels", {}).get(ENTRY_LABEL)):
        for user in entry_users(namespace, key):
            reconcile(kube(), user)


@kopf.on.event("", "v1", "pods", labels={ENTRY_LABEL: kopf.PRESENT})
def on_loader_pod(type, body, meta, namespace, **_) -> None:  # noqa: A002
    """A model cache loader finished: success is recorded on its claim and the users' Deployments are
    applied; a failure is shown in the users' status (the Job retries)."""
    if not _cached(LOADER, type, body) or type == "DELETED":
        return
    phase = (body.get("status") or {}).get("phase")
    users = entry_users(namespace, meta.get("labels", {}).get(ENTRY_LABEL))
    if phase == "Succeeded" and record_fill(kube(), dict(body)):
        for user in users:
            reconcile(kube(), user)
    elif phase == "Failed":
        for user in users:
            refresh_status(kube(), namespace, user["metadata"]["name"])


@kopf.on.startup()
def prime_cache(**_) -> None:
    """One listing of each kind before the handlers run: the first reconciles see the pods and
    Deployments that exist (the watch streams then keep the cache current)."""
    namespaces = _watched_namespaces() or [None]
    k = kube()
    CACHE.replace_all(ISVC, [o for ns in namespaces for o in k.list(f"{GROUP}/{VERSION}", KIND, ns)])
    CACHE.replace_all(POD, [o for ns in namespaces for o in k.list("v1", "Pod", ns, ISVC_LABEL)])
    CACHE.replace_all(DEPLOYMENT, [o for ns in namespaces for o in k.list("apps/v1", "Deployment", ns, "=".join(MANAGED_BY))])
    if k.has_kind(LWS_API, "LeaderWorkerSet"):  # (an optional kind: a cluster without LeaderWorkerSet serves one-pod replicas)
        CACHE.replace_all(LWS, [o for ns in namespaces for o in k.list(LWS_API, "LeaderWorkerSet", ns, "=".join(MANAGED_BY))])
    CACHE.replace_all(CLAIM, [o for ns in namespaces for o in k.list("v1", "PersistentVolumeClaim", ns, "=".join(MANAGED_BY))])
    CACHE.replace_all(LOADER, [o for ns in namespaces for o in k.list("v1", "Pod", ns, ENTRY_LABEL)])


def _watched_namespaces() -> list[str]:
    return [n for n in os.environ.get("KVPILOT_WATCH_NAMESPACES", "").split(",") if n]


class AutoscalerLoop:
    """Evaluates every InferenceService at its own spec.autoscaling.intervalSeconds.

    One loop for all objects rather than a kopf timer per object: kopf guards timers with a
    finalizer, so deleting an InferenceService would then hang whenever the operator is down."""

    def __init__(self) -> None:
        self.states: dict[str, AutoscalerState] = {}
        self.names: set[tuple[str, str]] = set()  # (namespace, name) last listed: whose metrics to drop when gone
        self.stop = threading.Event()

    def run(self) -> None:
        source = PrometheusSource(os.environ.get("KVPILOT_PROMETHEUS_URL", "http://127.0.0.1:9090"))
        while not self.stop.wait(1.0):
            objects = CACHE.all(ISVC)  # the watch cache: no LIST per pass
            live = set()
            for body in objects:
                uid = body["metadata"]["uid"]
                live.add(uid)
                if body["metadata"].get("deletionTimestamp"):
                    continue
                try:
                    evaluate(kube(), source, body, self.states.setdefault(uid, AutoscalerState()), time.time())
                    retry_if_waiting(kube(), body)
                except Exception:  # noqa: BLE001 - one bad object must not stop the others
                    log.exception("autoscaler: %s/%s", body["metadata"]["namespace"], body["metadata"]["name"])
            for uid in set(self.states) - live:
                del self.states[uid]
            known = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objects}
            for namespace, name in self.names - known:
                metrics.forget(namespace, name)
            self.names = known


_loop: AutoscalerLoop | None = None


@kopf.on.startup()
def start_autoscaler(**_) -> None:
    global _loop
    _loop = AutoscalerLoop()
    threading.Thread(target=_loop.run, name="autoscaler", daemon=True).start()


_adapters: AdapterSync | None = None


@kopf.on.startup()
def start_adapter_sync(**_) -> None:
    global _adapters
    _adapters = AdapterSync(kube(), parse_spec, lambda namespace, name, report: record_adapter_report(kube(), namespace, name, report))
    threading.Thread(target=_adapters.run, name="adapter-sync", daemon=True).start()


@kopf.on.cleanup()
def stop_autoscaler(**_) -> None:
    if _loop is not None:
        _loop.stop.set()
    if _adapters is not None:
        _adapters.stop.set()
        _adapters.poke()
