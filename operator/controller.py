"""kopf handlers: thin wrappers that call reconcile() for the InferenceService concerned."""

from __future__ import annotations

import logging
import os
import time

import kopf

from kvpilot.operator.crd_types import GROUP, ISVC_LABEL, MANAGED_BY, PLURAL, VERSION
from kvpilot.operator.autoscaler.loop import AutoscalerState, evaluate
from kvpilot.operator.autoscaler.promql import PrometheusSource
from kvpilot.operator.kube import Kube
from kvpilot.operator.reconcile import reconcile

log = logging.getLogger("kvpilot.operator")
_kube: Kube | None = None
_autoscalers: dict[str, AutoscalerState] = {}


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


@kopf.timer(GROUP, VERSION, PLURAL, interval=1.0, initial_delay=1.0)
def autoscale(body, meta, **_) -> None:
    """Runs every second; evaluates each InferenceService at its own spec.autoscaling.intervalSeconds."""
    if meta.get("deletionTimestamp"):
        return
    state = _autoscalers.setdefault(meta["uid"], AutoscalerState())
    source = PrometheusSource(os.environ.get("KVPILOT_PROMETHEUS_URL", "http://127.0.0.1:9090"))
    evaluate(kube(), source, dict(body), state, time.time())


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def forget(meta, **_) -> None:
    _autoscalers.pop(meta["uid"], None)
