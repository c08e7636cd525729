"""kopf handlers: thin wrappers that call reconcile() for the InferenceService concerned."""

from __future__ import annotations

import logging
import os
import threading
import time

import kopf

from kvpilot.operator import metrics
from kvpilot.operator.autoscaler.loop import AutoscalerState, evaluate
from kvpilot.operator.autoscaler.promql import PrometheusSource
from kvpilot.operator.crd_types import GROUP, ISVC_LABEL, MANAGED_BY, PLURAL, VERSION
from kvpilot.operator.kube import Kube
from kvpilot.operator.reconcile import reconcile

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
    settings.watching.server_timeout = 120
    settings.execution.max_workers = 8


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def on_inference_service(body, **_) -> None:
    reconcile(kube(), dict(body))


def _reconcile_owner(namespace: str, name: str | None) -> None:
    if not name:
        return
    body = kube().get_isvc(name, namespace)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    reconcile(kube(), body)


@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY[0]: MANAGED_BY[1]})
@kopf.on.event("", "v1", "services", labels={MANAGED_BY[0]: MANAGED_BY[1]})
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels={MANAGED_BY[0]: MANAGED_BY[1]})
def on_owned_object(body, meta, namespace, **_) -> None:
    """Drift (a hand edit, a deletion) is undone; Deployment status changes refresh ours."""
    _reconcile_owner(namespace, meta.get("labels", {}).get(ISVC_LABEL))


@kopf.on.event("", "v1", "pods", labels={ISVC_LABEL: kopf.PRESENT})
def on_engine_pod(meta, namespace, **_) -> None:
    _reconcile_owner(namespace, meta.get("labels", {}).get(ISVC_LABEL))


class AutoscalerLoop:
    """Evaluates every InferenceService at its own spec.autoscaling.intervalSeconds.

    One loop for all objects rather than a kopf timer per object: kopf guards timers with a
    finalizer, so deleting an InferenceService would then hang whenever the operator is down."""

    def __init__(self, namespaces: list[str]):
        self.namespaces = namespaces
        self.states: dict[str, AutoscalerState] = {}
        self.names: set[tuple[str, str]] = set()  # (namespace, name) last listed: whose metrics to drop when gone
        self.stop = threading.Event()

    def _objects(self) -> list[dict]:
        api = kube().custom
        if not self.namespaces:
            return api.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
        return [o for ns in self.namespaces for o in api.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]]

    def run(self) -> None:
        source = PrometheusSource(os.environ.get("KVPILOT_PROMETHEUS_URL", "http://127.0.0.1:9090"))
        while not self.stop.wait(1.0):
            try:
                objects = self._objects()
            except Exception as e:  # noqa: BLE001 - the API server blinked: try again next second
                log.warning("autoscaler: cannot list InferenceServices: %s", e)
                continue
            live = set()
            for body in objects:
                uid = body["metadata"]["uid"]
                live.add(uid)
                if body["metadata"].get("deletionTimestamp"):
                    continue
                try:
                    evaluate(kube(), source, body, self.states.setdefault(uid, AutoscalerState()), time.time())
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
    namespaces = [n for n in os.environ.get("KVPILOT_WATCH_NAMESPACES", "").split(",") if n]
    _loop = AutoscalerLoop(namespaces)
    threading.Thread(target=_loop.run, name="autoscaler", daemon=True).start()


@kopf.on.cleanup()
def stop_autoscaler(**_) -> None:
    if _loop is not None:
        _loop.stop.set()
