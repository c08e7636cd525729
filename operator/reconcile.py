"""One reconcile of an InferenceService: validate, render, apply, compute status. Called by thin kopf handlers."""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict

from kubernetes.client.rest import ApiException
from kubernetes.dynamic.exceptions import DynamicApiError
from pydantic import ValidationError

from kvpilot.operator import metrics
from kvpilot.operator.builders.engines import engine_container, unsupported_settings
from kvpilot.operator.builders.manifests import desired_replicas, endpoint_url, render, selector_labels
from kvpilot.operator.crd_types import InferenceServiceSpec, InferenceServiceStatus
from kvpilot.operator.kube import Kube
from kvpilot.operator.status import compute_status
from kvpilot.server.model_files import BUNDLED

log = logging.getLogger("kvpilot.operator")
FAULT_ENV = "KVPILOT_TEST_FAULT_POINT"  # test-only: "point" or "point@namespace/name": crash there


_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()


def isvc_lock(namespace: str, name: str) -> threading.Lock:
    """Reconcile and the autoscaler both write status: one at a time per InferenceService, each from a fresh read."""
    with _locks_guard:
        return _locks[(namespace, name)]


def fault_point(name: str, namespace: str, isvc: str) -> None:
    want = os.environ.get(FAULT_ENV)
    if want in (name, f"{name}@{namespace}/{isvc}"):
        log.error("test fault point %r reached for %s/%s: exiting", name, namespace, isvc)
        os._exit(17)


def parse_spec(body: dict) -> tuple[InferenceServiceSpec | None, list[tuple[str, str]]]:
    """The spec as our model, or the problems that the schema could not catch."""
    try:
        spec = InferenceServiceSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:5])
        return None, [("InvalidSpec", msgs)]
    problems = [("UnsupportedSetting", p) for p in unsupported_settings(spec)]
    src = spec.model.source
    if spec.engine == "kvpilot" and "://" not in src and src not in BUNDLED:
        problems.append(("UnknownModel", f"model.source {src!r} is not a bundled model (bundled: {', '.join(sorted(BUNDLED))}); use https://, hf:// or pvc://"))
    if spec.engine != "kvpilot" and "://" not in src:
        problems.append(("UnknownModel", f"engine {spec.engine} needs a model it can fetch (hf://, https:// or pvc://), not the bundled name {src!r}"))
    if not problems:
        try:  # the engine's own config validation (kvpilot: EngineConfig), here rather than in a crash-looping pod
            engine_container(spec, (body.get("metadata") or {}).get("name", ""))
        except ValidationError as e:
            msgs = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'engineSettings'}: {err['msg']}" for err in e.errors()[:5])
            problems.append(("InvalidEngineSettings", msgs))
    return spec, problems


def reconcile(kube: Kube, body: dict) -> InferenceServiceStatus:
    meta = body["metadata"]
    labels = (meta["namespace"], meta["name"])
    metrics.RECONCILES.labels(*labels).inc()
    metrics.touch(*labels)
    try:
        with isvc_lock(meta["namespace"], meta["name"]):
            fresh = kube.get_isvc(meta["name"], meta["namespace"])
            if fresh is None or fresh["metadata"].get("deletionTimestamp"):
                return InferenceServiceStatus()
            status = _reconcile(kube, fresh)
    except Exception:
        metrics.RECONCILE_ERRORS.labels(*labels).inc()
        raise
    metrics.DESIRED.labels(*labels).set(status.desired_replicas or 0)
    metrics.READY.labels(*labels).set(status.ready_replicas or 0)
    return status


def _reconcile(kube: Kube, body: dict) -> InferenceServiceStatus:
    meta = body["metadata"]
    name, namespace, uid, generation = meta["name"], meta["namespace"], meta["uid"], meta.get("generation", 1)
    prev_raw = body.get("status") or {}
    prev = InferenceServiceStatus.model_validate(prev_raw) if prev_raw else None
    spec, problems = parse_spec(body)
    deployment = None
    if spec is not None and not problems:
        try:
            with_monitor = kube.has_kind("monitoring.coreos.com/v1", "PodMonitor")
            for obj in render(name, namespace, uid, spec, with_pod_monitor=with_monitor):
                applied = kube.apply(obj)
                if obj["kind"] == "Deployment":
                    deployment = applied
                    fault_point("after-deployment", namespace, name)
        except (ApiException, DynamicApiError) as e:
            reason = getattr(e, "reason", None) or type(e).__name__
            problems.append(("ApplyFailed", f"{reason}: {getattr(e, 'body', None) or e}"[:500]))
    if deployment is None:
        deployment = kube.get("apps/v1", "Deployment", name, namespace)
    selector = ",".join(f"{k}={v}" for k, v in selector_labels(name).items())
    pods = kube.list("v1", "Pod", namespace, selector)
    desired = desired_replicas(spec) if spec is not None else 0
    status = compute_status(prev, generation, desired, selector, endpoint_url(name, namespace), deployment, pods, problems,
                            wakes_from_zero=spec is not None and spec.min_replicas == 0 and spec.autoscaling.enabled)
    new_raw = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    if new_raw != prev_raw:
        kube.patch_isvc_status(name, namespace, new_raw)
        _emit_transitions(kube, body, prev, status)
    return status


def _emit_transitions(kube: Kube, body: dict, prev: InferenceServiceStatus | None, new: InferenceServiceStatus) -> None:
    """One Event per condition change that a person would want to see."""
    before = {c.type: (c.status, c.reason) for c in (prev.conditions if prev else [])}
    for c in new.conditions:
        if before.get(c.type) == (c.status, c.reason):
            continue
        if c.type == "Degraded" and c.status == "True":
            kube.event(body, "Warning", c.reason, c.message)
        elif c.type == "Ready":
            kube.event(body, "Normal" if c.status == "True" else "Warning", "Ready" if c.status == "True" else "NotReady", c.message)
        elif c.type == "Progressing" and c.status == "True" and c.reason == "RollingOut":
            kube.event(body, "Normal", "RollingOut", c.message)
