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
from kvpilot.operator.cache import CACHE, DEPLOYMENT, ISVC, POD
from kvpilot.operator.crd_types import InferenceServiceSpec, InferenceServiceStatus
from kvpilot.operator.kube import Kube
from kvpilot.operator.status import AutoscalerReport, compute_status, now_rfc3339, unchanged
from kvpilot.server.model_files import BUNDLED

log = logging.getLogger("kvpilot.operator")
FAULT_ENV = "KVPILOT_TEST_FAULT_POINT"  # test-only: "point" or "point@namespace/name": crash there


_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()
# Per InferenceService, in memory: the autoscaler's latest report, and the problems the last apply met
# (a status written between two reconciles keeps saying so).
REPORTS: dict[tuple[str, str], AutoscalerReport] = {}
_apply_problems: dict[tuple[str, str], list[tuple[str, str]]] = {}


def isvc_lock(namespace: str, name: str) -> threading.Lock:
    """One reconcile or status write at a time per InferenceService."""
    with _locks_guard:
        return _locks[(namespace, name)]


def forget(namespace: str, name: str) -> None:
    """An InferenceService is gone: drop what is kept for it."""
    REPORTS.pop((namespace, name), None)
    _apply_problems.pop((namespace, name), None)


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
    """Apply what the spec asks for (drift undone), then write status."""
    meta = body["metadata"]
    labels = (meta["namespace"], meta["name"])
    metrics.RECONCILES.labels(*labels).inc()
    metrics.touch(*labels)
    try:
        with isvc_lock(*labels):
            fresh = CACHE.newest(ISVC, body)
            if fresh["metadata"].get("deletionTimestamp"):
                return InferenceServiceStatus()
            status = _reconcile(kube, fresh)
    except Exception:
        metrics.RECONCILE_ERRORS.labels(*labels).inc()
        raise
    metrics.DESIRED.labels(*labels).set(status.desired_replicas or 0)
    metrics.READY.labels(*labels).set(status.ready_replicas or 0)
    return status


def refresh_status(kube: Kube, namespace: str, name: str) -> InferenceServiceStatus | None:
    """Status alone, from the cache (a pod changed; the autoscaler reported): nothing applied."""
    with isvc_lock(namespace, name):
        body = CACHE.get(ISVC, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        spec, problems = parse_spec(body)
        return write_status(kube, body, spec, problems + _apply_problems.get((namespace, name), []))


def _reconcile(kube: Kube, body: dict) -> InferenceServiceStatus:
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    spec, problems = parse_spec(body)
    applying: list[tuple[str, str]] = []
    if spec is not None and not problems:
        try:
            with_monitor = kube.has_kind("monitoring.coreos.com/v1", "PodMonitor")
            for obj in render(name, namespace, uid, spec, with_pod_monitor=with_monitor):
                applied = kube.apply(obj)
                if obj["kind"] == "Deployment":
                    CACHE.put(DEPLOYMENT, applied)
                    fault_point("after-deployment", namespace, name)
        except (ApiException, DynamicApiError) as e:
            reason = getattr(e, "reason", None) or type(e).__name__
            applying.append(("ApplyFailed", f"{reason}: {getattr(e, 'body', None) or e}"[:500]))
    _apply_problems[(namespace, name)] = applying
    return write_status(kube, body, spec, problems + applying)


def write_status(kube: Kube, body: dict, spec: InferenceServiceSpec | None, problems: list[tuple[str, str]]) -> InferenceServiceStatus:
    """The one writer of status (under the service's lock): computed from the cached Deployment and pods,
    with the autoscaler's latest report applied; written only when more than a timestamp changed."""
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation", 1)
    prev_raw = body.get("status") or {}
    prev = InferenceServiceStatus.model_validate(prev_raw) if prev_raw else None
    deployment = CACHE.get(DEPLOYMENT, namespace, name)
    pods = CACHE.with_labels(POD, namespace, selector_labels(name))
    selector = ",".join(f"{k}={v}" for k, v in selector_labels(name).items())
    desired = desired_replicas(spec) if spec is not None else 0
    status = compute_status(prev, generation, desired, selector, endpoint_url(name, namespace), deployment, pods, problems,
                            wakes_from_zero=spec is not None and spec.min_replicas == 0 and spec.autoscaling.enabled)
    report = REPORTS.get((namespace, name))
    if report is not None:
        report.apply(status, now_rfc3339())
    new_raw = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    if not unchanged(prev_raw, new_raw):
        try:
            written = kube.patch_isvc_status(name, namespace, new_raw)
        except ApiException as e:
            if e.status != 404:
                raise
            # deleted since the cache last heard of it (its DELETED event is on its way): nothing to write
            CACHE.delete(ISVC, namespace, name)
            forget(namespace, name)
            return status
        CACHE.put(ISVC, written)
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
