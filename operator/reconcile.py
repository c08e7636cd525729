"""One reconcile of an InferenceService: validate, render, apply, compute status. Called by thin kopf handlers."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import defaultdict
from datetime import datetime

from kubernetes.client.rest import ApiException
from kubernetes.dynamic.exceptions import DynamicApiError
from pydantic import ValidationError

from kvpilot.operator import cold_start, metrics
from kvpilot.operator.adapter_sync import AdapterReport
from kvpilot.operator.builders import model_cache
from kvpilot.operator.builders.engines import (
    engine_container,
    group_flag_problems,
    kv_capacity_problem,
    served_name,
    shared_cache,
    unsupported_settings,
)
from kvpilot.operator.builders.manifests import (
    ENGINE_LABEL,
    LWS_API,
    desired_prefill_replicas,
    desired_replicas,
    endpoint_url,
    group_name,
    hf_token_env,
    is_group_worker,
    is_prefill_pod,
    kv_transfer_name,
    kv_transfer_secret,
    pod_selector,
    pod_template,
    prefill_name,
    render,
    selector_labels,
)
from kvpilot.operator.builders.pod_template import patch_problems, pod_problems
from kvpilot.operator.cache import CACHE, CLAIM, DEPLOYMENT, ISVC, LOADER, LWS, POD
from kvpilot.operator.crd_types import MANAGED_BY, AdapterStatus, ColdStart, InferenceServiceSpec, InferenceServiceStatus, ModelCacheEntryStatus, PoolStatus
from kvpilot.operator.kube import Kube
from kvpilot.operator.status import AutoscalerReport, compute_status, group_statuses, now_rfc3339, set_condition, unchanged
from kvpilot.server.model_files import BUNDLED

log = logging.getLogger("kvpilot.operator")
FAULT_ENV = "KVPILOT_TEST_FAULT_POINT"  # test-only: "point" or "point@namespace/name": crash there
# <name>-group-<index>-<hash> (a worker StatefulSet's revision label) stays within a label's 63 characters
MAX_GROUPED_NAME = 40


_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()
# Per InferenceService, in memory: the autoscaler's latest report, and the problems the last apply met
# (a status written between two reconciles keeps saying so).
REPORTS: dict[tuple[str, str], AutoscalerReport] = {}
PREFILL_REPORTS: dict[tuple[str, str], PoolStatus] = {}  # the autoscaler's latest about a prefill pool (metrics, decision)
ADAPTER_REPORTS: dict[tuple[str, str], AdapterReport] = {}  # the adapter sync's latest, per service
_apply_problems: dict[tuple[str, str], list[tuple[str, str]]] = {}
# Per InferenceService, the resourceVersion each owned object (by kind and name) had after our last apply:
# the watch's echo of our own write is not drift (a reconcile for it would apply everything again).
_applied_versions: dict[tuple[str, str], dict[tuple[str, str], str]] = {}


def isvc_lock(namespace: str, name: str) -> threading.Lock:
    """One reconcile or status write at a time per InferenceService."""
    with _locks_guard:
        return _locks[(namespace, name)]


_cold_starts: dict[tuple[str, str], ColdStart] = {}  # the newest measured engine pod start, until written
_measured: set[str] = set()  # pod uids whose start was measured
COLD_START_FRESH_SECONDS = 120  # a pod Ready for longer (seen after an operator restart) is not measured again


def forget(namespace: str, name: str) -> None:
    """An InferenceService is gone: drop what is kept for it."""
    REPORTS.pop((namespace, name), None)
    PREFILL_REPORTS.pop((namespace, name), None)
    ADAPTER_REPORTS.pop((namespace, name), None)
    _apply_problems.pop((namespace, name), None)
    _applied_versions.pop((namespace, name), None)
    _cold_starts.pop((namespace, name), None)


def forget_pod(uid: str) -> None:
    _measured.discard(uid)


def record_cold_start(namespace: str, name: str, pod: dict) -> None:
    """A pod that turned Ready in the last two minutes: its start by phase, from its timestamps and (a
    kvpilot engine) its /metrics; into the operator's histograms and, as the newest, the status."""
    uid = pod["metadata"]["uid"]
    if uid in _measured or pod["metadata"].get("deletionTimestamp") or is_group_worker(pod):  # (a group's start is its leader's)
        return
    first = cold_start.cold_start(pod, None, {})
    if first is None or time.time() - datetime.fromisoformat(first.ready_time.replace("Z", "+00:00")).timestamp() > COLD_START_FRESH_SECONDS:
        return
    _measured.add(uid)
    engine = next((c for c in pod["spec"]["containers"] if c["name"] == "engine"), None)
    measured = first
    ip = (pod.get("status") or {}).get("podIP")
    if ip and engine is not None and pod["metadata"].get("labels", {}).get(ENGINE_LABEL) == "kvpilot":
        port = next((p["containerPort"] for p in engine.get("ports") or [] if p.get("name") == "http"), 8000)
        measured = cold_start.cold_start(pod, *cold_start.read_engine_startup(f"http://{ip}:{port}/metrics")) or first
    for phase in measured.phases:
        metrics.COLD_START.labels(phase.name).observe(phase.seconds)
    metrics.COLD_START.labels("total").observe(measured.total_seconds)
    with isvc_lock(namespace, name):
        newest = _cold_starts.get((namespace, name))
        if newest is None or newest.ready_time <= measured.ready_time:
            _cold_starts[(namespace, name)] = measured


def fault_point(name: str, namespace: str, isvc: str) -> None:
    want = os.environ.get(FAULT_ENV)
    if want in (name, f"{name}@{namespace}/{isvc}"):
        log.error("test fault point %r reached for %s/%s: exiting", name, namespace, isvc)
        os._exit(17)


def cache_defaults() -> model_cache.CacheDefaults:
    """The operator's model cache defaults (its flags, passed on through the environment)."""
    d = model_cache.CacheDefaults()
    return model_cache.CacheDefaults(mode=os.environ.get("KVPILOT_MODEL_CACHE_MODE") or d.mode,
                                     storage_class_name=os.environ.get("KVPILOT_MODEL_CACHE_STORAGE_CLASS") or None,
                                     size=os.environ.get("KVPILOT_MODEL_CACHE_SIZE") or d.size,
                                     compile_cache_size=os.environ.get("KVPILOT_COMPILE_CACHE_SIZE") or d.compile_cache_size)


def kv_transfer_policy_enabled() -> bool:
    """Whether disaggregated services get their KV transfer NetworkPolicy (the chart's networkPolicy.kvTransfer.enabled,
    passed on through the environment; on unless set to false)."""
    return os.environ.get("KVPILOT_KV_TRANSFER_NETWORK_POLICY", "true").lower() != "false"


def parse_spec(body: dict) -> tuple[InferenceServiceSpec | None, list[tuple[str, str]]]:
    """The spec as our model (the operator's defaults filled in), or the problems that the schema could not catch."""
    try:
        spec = model_cache.with_defaults(InferenceServiceSpec.model_validate(body.get("spec") or {}), cache_defaults())
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:5])
        return None, [("InvalidSpec", msgs)]
    problems = [("UnsupportedSetting", p) for p in unsupported_settings(spec)]
    if spec.pod_template is not None:
        problems += [("InvalidPodTemplate", p) for p in patch_problems(spec.pod_template.spec)]
    src = spec.model.source
    in_image = sorted(name for name, bundled in BUNDLED.items() if bundled.fetch_from is None)
    if spec.engine == "kvpilot" and "://" not in src and src not in in_image:
        elsewhere = f"; the engine image does not carry {src!r}: source {BUNDLED[src].fetch_from}" if src in BUNDLED else ""
        problems.append(("UnknownModel", f"model.source {src!r} is not a bundled model (in the engine image: {', '.join(in_image)}){elsewhere}; "
                                         "use https://, hf:// or pvc://"))
    if spec.engine != "kvpilot" and "://" not in src:
        problems.append(("UnknownModel", f"engine {spec.engine} needs a model it can fetch (hf://, https:// or pvc://), not the bundled name {src!r}"))
    if not problems:
        try:  # the engine's own config validation (kvpilot: EngineConfig), here rather than in a crash-looping pod
            for pool in ("decode", "prefill") if spec.disaggregation else (None,):
                engine_container(spec, (body.get("metadata") or {}).get("name", ""), pool)
                too_small = kv_capacity_problem(spec, (body.get("metadata") or {}).get("name", ""), pool) if spec.engine == "kvpilot" else None
                if too_small:
                    problems.append(("InvalidEngineSettings", too_small))
                    break
            if spec.pod_template is not None:  # the pod the patch makes, held to what the operator's own pods are
                problems += [("InvalidPodTemplate", p) for p in pod_problems(pod_template((body.get("metadata") or {}).get("name", ""), spec)["spec"])]
            if spec.group_size > 1:  # a group's worker pods too, with the engine flags the leader has
                name = (body.get("metadata") or {}).get("name", "")
                problems += [("InvalidEngineSettings", p) for p in group_flag_problems(spec, name)]
                if len(name) > MAX_GROUPED_NAME:
                    problems.append(("InvalidName", f"a service whose replicas are groups of pods has a name of at most {MAX_GROUPED_NAME} "
                                     f"characters (LeaderWorkerSet names its StatefulSets and pods after it), not {len(name)}"))
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


def record_adapter_report(kube: Kube, namespace: str, name: str, report: AdapterReport) -> None:
    """The adapter sync's pass over one service: status is written when what it found changed."""
    if ADAPTER_REPORTS.get((namespace, name)) != report:
        ADAPTER_REPORTS[(namespace, name)] = report
        refresh_status(kube, namespace, name)


def name_collisions(body: dict, spec: InferenceServiceSpec | None) -> list[tuple[str, str]]:
    """Adapter names that clash with a served model or adapter name: with the service's own served
    name, or with another service's created earlier (the gateway routes a name to the older one; the
    younger is Degraded)."""
    if spec is None or not spec.adapters:
        mine: set[str] = set()
    else:
        mine = {a.name for a in spec.adapters}
    meta = body["metadata"]
    served = served_name(spec, meta["name"]) if spec is not None else meta["name"]
    problems = [("AdapterNameCollision", f"adapter {n!r} has the service's own served model name") for n in sorted(mine & {served})]
    age = (meta.get("creationTimestamp") or "", meta["namespace"], meta["name"])
    for other in CACHE.all(ISVC):
        om, ospec = other["metadata"], other.get("spec") or {}
        if om.get("deletionTimestamp") or (om.get("creationTimestamp") or "", om["namespace"], om["name"]) >= age:
            continue
        their_adapters = {a.get("name") for a in ospec.get("adapters") or [] if isinstance(a, dict)}
        theirs = their_adapters | {(ospec.get("model") or {}).get("servedName") or om["name"]}
        for n in sorted((mine & theirs) | ({served} & their_adapters)):
            problems.append(("AdapterNameCollision", f"{n!r} is also served by InferenceService {om['namespace']}/{om['name']} (older: "
                                                     "the gateway routes the name there)"))
    return problems


def _adapter_status(status: InferenceServiceStatus, spec: InferenceServiceSpec | None, report: AdapterReport | None, generation: int) -> None:
    """status.adapters and the AdaptersReady condition, from the adapter sync's report when it is for the current spec."""
    if spec is None or not spec.adapters:
        status.adapters, status.adapter_count = [], 0 if spec is not None else None
        status.conditions = [c for c in status.conditions if c.type != "AdaptersReady"]
        return
    status.adapter_count = len(spec.adapters)
    if report is not None and report.desired == {a.name: a.source for a in spec.adapters}:
        status.adapters, ready = report.adapters, report.ready
    else:
        status.adapters = [AdapterStatus(name=a.name, source=a.source) for a in spec.adapters]
        ready = ("False", "Loading", "the adapters are being loaded into the Ready pods")
    status.conditions = set_condition(status.conditions, "AdaptersReady", *ready, generation, now_rfc3339())


def _prefill_status(status: InferenceServiceStatus, spec: InferenceServiceSpec | None, deployment: dict | None, pods: list[dict],
                    report: PoolStatus | None, generation: int) -> None:
    """status.prefill, and the prefill pool's rollout in Progressing (the service is Ready on its decode pods: without a prefill
    pod, the gateway sends requests to the decode pods alone)."""
    if spec is None or spec.disaggregation is None:
        status.prefill = None
        return
    dstat = (deployment or {}).get("status") or {}
    desired = desired_prefill_replicas(spec)
    pool = PoolStatus(replicas=dstat.get("replicas", 0), ready_replicas=dstat.get("readyReplicas", 0), desired_replicas=desired)
    if report is not None:
        pool.last_metrics, pool.scaling = report.last_metrics, report.scaling
    status.prefill = pool
    progressing = next((c for c in status.conditions if c.type == "Progressing"), None)
    updated = dstat.get("updatedReplicas", 0)
    if progressing is not None and progressing.reason == "Stable" and (deployment is None or min(updated, pool.ready_replicas) < desired
                                                                       or pool.replicas > desired):
        status.conditions = set_condition(status.conditions, "Progressing", "True", "RollingOut",
                                          f"prefill pool: {updated}/{desired} pods updated, {pool.ready_replicas}/{desired} ready "
                                          f"({sum(1 for p in pods if not p['metadata'].get('deletionTimestamp'))} pods)", generation, now_rfc3339())


def refresh_status(kube: Kube, namespace: str, name: str) -> InferenceServiceStatus | None:
    """Status alone, from the cache (a pod changed; the autoscaler reported): nothing applied."""
    with isvc_lock(namespace, name):
        body = CACHE.get(ISVC, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        spec, problems = parse_spec(body)
        return write_status(kube, body, spec, problems + _apply_problems.get((namespace, name), []))


def _raw_group_size(spec: dict) -> int:
    """InferenceServiceSpec.group_size from the stored spec, without validating it (each autoscaler pass asks, per service)."""
    settings, per_pod = spec.get("engineSettings") or {}, (spec.get("resources") or {}).get("gpusPerPod")
    gpus = settings.get("tensorParallelSize", 1) * settings.get("pipelineParallelSize", 1)
    return gpus // per_pod if per_pod else 1


def _handover_due(namespace: str, name: str, group_size: int, desired: int) -> bool:
    """Replicas that became groups of pods (or stopped being them): the previous workload is still there and the new one
    serves (its first replica Ready, or none asked for): the previous one can go."""
    grouped = group_size > 1
    old = CACHE.get(DEPLOYMENT, namespace, name) if grouped else CACHE.get(LWS, namespace, group_name(name))
    new = CACHE.get(LWS, namespace, group_name(name)) if grouped else CACHE.get(DEPLOYMENT, namespace, name)
    return old is not None and new is not None and ((new.get("status") or {}).get("readyReplicas") or 0) >= min(desired, 1)


def retry_if_waiting(kube: Kube, body: dict) -> None:
    """Each autoscaler pass, per service: a reconcile for one whose last reconcile waits on the cluster — LeaderWorkerSet was
    not installed (has_kind asks again every minute), or a handover's new workload turned ready (its status events refresh
    status only). Cheap when neither: cache lookups."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    spec = body.get("spec") or {}
    if any(reason == "LeaderWorkerSetMissing" for reason, _ in _apply_problems.get((namespace, name), [])):
        if kube.has_kind(LWS_API, "LeaderWorkerSet"):
            reconcile(kube, body)
    elif _handover_due(namespace, name, _raw_group_size(spec), spec.get("replicas", spec.get("minReplicas", 1))):
        reconcile(kube, body)


def _reconcile(kube: Kube, body: dict) -> InferenceServiceStatus:
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    spec, problems = parse_spec(body)
    applying: list[tuple[str, str]] = []
    if spec is not None and not problems and spec.group_size > 1 and not kube.has_kind(LWS_API, "LeaderWorkerSet"):
        applying.append(("LeaderWorkerSetMissing", f"resources.gpusPerPod={spec.gpus_per_pod} makes each replica a group of "
                         f"{spec.group_size} pods, a LeaderWorkerSet, and this cluster does not serve {LWS_API} LeaderWorkerSet: install "
                         "LeaderWorkerSet (kubernetes-sigs/lws, v0.7.0 or later), or leave gpusPerPod unset (one pod per replica)"))
    if spec is not None and not problems and not applying:
        try:
            cache_ready = _apply_model_cache(kube, body, spec)
            if spec.disaggregation is not None:  # before the pools' pods, which read it; one already there is kept (no rotation)
                kube.create_unless_present(kv_transfer_secret(name, namespace, uid, spec, secrets.token_urlsafe(32)))
            with_monitor = kube.has_kind("monitoring.coreos.com/v1", "PodMonitor")
            with_policy = kv_transfer_policy_enabled()
            for obj in render(name, namespace, uid, spec, with_pod_monitor=with_monitor, with_kv_transfer_policy=with_policy):
                if obj["kind"] in ("Deployment", "LeaderWorkerSet") and not cache_ready:
                    continue  # pods start once their model cache entries are filled (the running ones keep serving)
                applied = kube.apply(obj)
                _applied_versions.setdefault((namespace, name), {})[(obj["kind"], obj["metadata"]["name"])] = applied["metadata"].get("resourceVersion")
                if obj["kind"] == "Deployment":
                    CACHE.put(DEPLOYMENT, applied)
                    fault_point("after-deployment", namespace, name)
                elif obj["kind"] == "LeaderWorkerSet":
                    CACHE.put(LWS, applied)
            # Replicas that became groups of pods, or stopped being them: the previous workload serves until the new one
            # does (retry_if_waiting comes back for it), then goes.
            if cache_ready and _handover_due(namespace, name, spec.group_size, desired_replicas(spec)):
                kind, gone = (("apps/v1", "Deployment"), name) if spec.group_size > 1 else ((LWS_API, "LeaderWorkerSet"), group_name(name))
                kube.delete(*kind, gone, namespace)
                CACHE.delete(DEPLOYMENT if spec.group_size > 1 else LWS, namespace, gone)
            if spec.disaggregation is None and CACHE.get(DEPLOYMENT, namespace, prefill_name(name)) is not None:
                # disaggregation turned off: the prefill pool goes (its pods drain; the gateway stops prefilling first)
                # The KV transfer Secret stays (nothing reads it; the garbage collector deletes it with the service): deleting it
                # would take the right to delete every Secret of the namespace.
                kube.delete("apps/v1", "Deployment", prefill_name(name), namespace)
                kube.delete("policy/v1", "PodDisruptionBudget", prefill_name(name), namespace)
                kube.delete("networking.k8s.io/v1", "NetworkPolicy", kv_transfer_name(name), namespace)
                CACHE.delete(DEPLOYMENT, namespace, prefill_name(name))
            elif spec.disaggregation is not None and not with_policy:
                # turned off in the operator: one an earlier run made goes (the policies are not cached: a delete each reconcile)
                kube.delete("networking.k8s.io/v1", "NetworkPolicy", kv_transfer_name(name), namespace)
        except (ApiException, DynamicApiError) as e:
            reason = getattr(e, "reason", None) or type(e).__name__
            applying.append(("ApplyFailed", f"{reason}: {getattr(e, 'body', None) or e}"[:500]))
    _apply_problems[(namespace, name)] = applying
    return write_status(kube, body, spec, problems + applying)


def is_own_write(namespace: str, owner: str, obj: dict) -> bool:
    """Whether `obj` (an owned object from a watch event) is exactly what our last apply of it wrote."""
    version = obj["metadata"].get("resourceVersion")
    key = (obj.get("kind"), obj["metadata"].get("name"))
    return version is not None and _applied_versions.get((namespace, owner), {}).get(key) == version


def _apply_model_cache(kube: Kube, body: dict, spec: InferenceServiceSpec) -> bool:
    """The entries this service's pods mount (mode Shared): each claim with this service among its
    owners, a loader Job for each entry not yet filled; entries it no longer uses are let go of
    (`_let_go`). True when every entry is Ready."""
    meta = body["metadata"]
    namespace, user = meta["namespace"], (meta["name"], meta["uid"])
    manager = model_cache.user_field_manager(meta["uid"])
    files = model_cache.cached_files(spec)
    used = {model_cache.claim_name(f.source) for f in files}
    # What it owns, read off the claims: not off status.modelCache, which a status write from the new spec (the
    # autoscaler's, a pod's event) may have rewritten before this reconcile ran; a let-go that failed is retried here.
    for existing in CACHE.with_labels(CLAIM, namespace, {MANAGED_BY[0]: MANAGED_BY[1]}):
        m = existing["metadata"]
        source = (m.get("annotations") or {}).get(model_cache.SOURCE_ANNOTATION)
        if (source and model_cache.claim_name(source) == m["name"] and m["name"] not in used and not m.get("deletionTimestamp")
                and any(o.get("uid") == meta["uid"] for o in m.get("ownerReferences") or [])):
            try:  # (one the API server refuses does not hold up the entries in use: tried again next time)
                _let_go(kube, model_cache.entry_claim(source, namespace, spec, None, existing), manager)
            except (ApiException, DynamicApiError) as e:
                log.warning("%s/%s: letting go of the cache entry %s failed (%s); tried again at the next reconcile",
                            namespace, meta["name"], m["name"], getattr(e, "reason", None) or e)
    compile_claim = CACHE.get(CLAIM, namespace, model_cache.COMPILE_CACHE_CLAIM)
    if shared_cache(spec):
        CACHE.put(CLAIM, kube.apply(model_cache.compile_cache_claim(namespace, spec, cache_defaults(), user, compile_claim), field_manager=manager))
    elif compile_claim is not None and any(o.get("uid") == meta["uid"] for o in compile_claim["metadata"].get("ownerReferences") or []):
        _let_go(kube, model_cache.compile_cache_claim(namespace, spec, cache_defaults(), None, compile_claim), manager)
    ready = True
    for files_ in files:
        name = model_cache.claim_name(files_.source)
        claim = kube.apply(model_cache.entry_claim(files_.source, namespace, spec, user, CACHE.get(CLAIM, namespace, name)), field_manager=manager)
        CACHE.put(CLAIM, claim)
        state = model_cache.entry_state(claim, _loader_pods(namespace, files_.source))[0]
        if state != "Ready":
            ready = False
            kube.create_unless_present(model_cache.fill_job(files_, namespace, spec, claim, hf_token_env(spec)))
    return ready


def _let_go(kube: Kube, claim: dict, manager: str) -> None:
    """This service no longer uses a shared claim: its ownerReference goes (its field manager applies
    the claim without it). With no owner left the claim is deleted — the garbage collector deletes only
    what lost its owners by their deletion, not by their letting go."""
    meta = claim["metadata"]
    applied = kube.apply(claim, field_manager=manager)
    if applied["metadata"].get("ownerReferences"):
        CACHE.put(CLAIM, applied)
    else:
        kube.delete("v1", "PersistentVolumeClaim", meta["name"], meta["namespace"])
        CACHE.delete(CLAIM, meta["namespace"], meta["name"])


def _loader_pods(namespace: str, source: str) -> list[dict]:
    return CACHE.with_labels(LOADER, namespace, {model_cache.ENTRY_LABEL: model_cache.entry_key(source)})


def model_cache_status(namespace: str, spec: InferenceServiceSpec | None) -> list[ModelCacheEntryStatus]:
    entries = []
    for files in model_cache.cached_files(spec) if spec is not None else []:
        claim = model_cache.claim_name(files.source)
        state, revision, size, message = model_cache.entry_state(CACHE.get(CLAIM, namespace, claim), _loader_pods(namespace, files.source))
        entries.append(ModelCacheEntryStatus(claim=claim, source=files.source, state=state, revision=revision, bytes=size, message=message))
    return entries


def record_fill(kube: Kube, loader_pod: dict) -> bool:
    """A loader pod succeeded: what it fetched goes on its entry's claim (the entry is then Ready).
    True when this recorded it (the claim's own watch event will not say so: the cache has it first)."""
    key = (loader_pod["metadata"].get("labels") or {}).get(model_cache.ENTRY_LABEL)
    namespace = loader_pod["metadata"]["namespace"]
    claim = next((c for c in CACHE.with_labels(CLAIM, namespace, {model_cache.ENTRY_LABEL: key})), None) if key else None
    if claim is None or model_cache.FILLED_ANNOTATION in (claim["metadata"].get("annotations") or {}):
        return False
    annotations = model_cache.filled_annotations(model_cache.termination_message(loader_pod), now_rfc3339())
    if annotations is None:
        log.warning("loader pod %s/%s succeeded without a fetch summary", namespace, loader_pod["metadata"]["name"])
        return False
    CACHE.put(CLAIM, kube.annotate_claim(claim["metadata"]["name"], namespace, annotations))
    return True


def entry_users(namespace: str, key: str) -> list[dict]:
    """The InferenceServices of a namespace whose pods mount the entry `key`."""
    users = []
    for body in CACHE.all(ISVC):
        if body["metadata"]["namespace"] != namespace or body["metadata"].get("deletionTimestamp"):
            continue
        spec, problems = parse_spec(body)
        if spec is not None and any(model_cache.entry_key(f.source) == key for f in model_cache.cached_files(spec)):
            users.append(body)
    return users


def write_status(kube: Kube, body: dict, spec: InferenceServiceSpec | None, problems: list[tuple[str, str]]) -> InferenceServiceStatus:
    """The one writer of status (under the service's lock): computed from the cached Deployment and pods,
    with the autoscaler's latest report applied; written only when more than a timestamp changed."""
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation", 1)
    prev_raw = body.get("status") or {}
    prev = InferenceServiceStatus.model_validate(prev_raw) if prev_raw else None
    grouped = spec is not None and spec.group_size > 1
    workload = CACHE.get(LWS, namespace, group_name(name)) if grouped else CACHE.get(DEPLOYMENT, namespace, name)
    all_pods = CACHE.with_labels(POD, namespace, selector_labels(name))
    pods = [p for p in all_pods if not is_prefill_pod(p)]  # (a group's workers too: a failed one is named in Degraded)
    selector = ",".join(f"{k}={v}" for k, v in pod_selector(name, spec).items())
    desired = desired_replicas(spec) if spec is not None else 0
    entries = model_cache_status(namespace, spec)
    problems = problems + [("ModelCacheFillFailed", f"model cache entry {e.claim} ({e.source}): {e.message}") for e in entries if e.state == "Failed"]
    filling = [e for e in entries if e.state == "Filling"]
    status = compute_status(prev, generation, desired, selector, endpoint_url(name, namespace), workload, pods, problems,
                            wakes_from_zero=spec is not None and spec.min_replicas == 0 and spec.autoscaling.enabled,
                            filling="; ".join(f"model cache entry {e.claim} ({e.source}) is being filled" for e in filling) or None,
                            serving_problems=name_collisions(body, spec))
    status.model_cache = entries
    status.groups = group_statuses(pods, spec.group_size) if grouped else []
    _prefill_status(status, spec, CACHE.get(DEPLOYMENT, namespace, prefill_name(name)), [p for p in all_pods if is_prefill_pod(p)],
                    PREFILL_REPORTS.get((namespace, name)), generation)
    _adapter_status(status, spec, ADAPTER_REPORTS.get((namespace, name)), generation)
    if (started := _cold_starts.get((namespace, name))) is not None:
        status.last_cold_start = started
    report = REPORTS.get((namespace, name))
    if report is not None:
        report.apply(status, now_rfc3339())
    new_raw = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    if "prefill" in prev_raw and "prefill" not in new_raw:
        new_raw["prefill"] = None  # a merge patch removes a field only by a null
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
        elif c.type == "AdaptersReady" and (c.status == "True" or c.reason not in ("Loading", "NoReadyPods")):
            kube.event(body, "Normal" if c.status == "True" else "Warning", "AdaptersLoaded" if c.status == "True" else c.reason, c.message)
