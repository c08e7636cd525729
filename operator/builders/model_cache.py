"""The model cache (`spec.model.cache`, mode Shared): pure builders of its objects.

An entry is a ReadWriteMany PersistentVolumeClaim per model source in a namespace, named by a hash of
the source (a source change is a new entry), filled once by a loader Job (`kvpilot fetch-model`, the
engine image) and mounted read-only by every engine pod of every InferenceService that serves the
source. Its users are its ownerReferences — one per InferenceService, each written by that service's
own field manager, so that server-side apply merges them — and the garbage collector deletes the claim
(and the Job it owns) when the last user is gone. What the loader fetched (an hf:// source's commit,
its bytes) is recorded on the claim's annotations, read from the loader pod's termination message.

The compile cache is one more claim per namespace (Triton's and torch's caches), owned the same way,
mounted read-write, so that a warm start does not compile again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kvpilot.operator.builders.engines import ModelFiles, image_pull_secrets, kvpilot_image, model_files
from kvpilot.operator.builders.pod_defaults import CACHE_DIR, CACHE_ENV, CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT
from kvpilot.operator.crd_types import GROUP, MANAGED_BY, InferenceServiceSpec

ENTRY_LABEL = f"{GROUP}/model-cache-entry"          # claim, Job and loader pod of one entry: its key
SOURCE_ANNOTATION = f"{GROUP}/model-source"
REVISION_ANNOTATION = f"{GROUP}/model-revision"
BYTES_ANNOTATION = f"{GROUP}/model-bytes"
FILLED_ANNOTATION = f"{GROUP}/filled-at"
COMPILE_CACHE_CLAIM = "kvpilot-compile-cache"
COMPILE_CACHE_DIR = "/cache/compile"
ENTRY_DIR = "/entry"                                # where the loader writes, in its pod
FILL_BACKOFF_LIMIT = 6                              # the Job controller's retries: 10 s, doubling, capped at 6 min
FILL_TIMEOUT_SECONDS = 1500
# A finished loader pod still counts as a user of its claim (pvc-protection): the Job goes 15 s after it
# ends (the operator records the fill from the pod's Succeeded event, sub-second; should it miss that, the
# next reconcile fills the entry again), or the claim could never be freed. A Job that failed for good
# goes too, and the next reconcile starts another.
FILL_JOB_TTL_SECONDS = 15


@dataclass(frozen=True, slots=True)
class CacheDefaults:
    """The operator's defaults (its flags; the chart's modelCache values) for what a spec leaves unset."""

    mode: str = "PerPod"
    storage_class_name: str | None = None
    size: str = "20Gi"
    compile_cache_size: str = "5Gi"


def with_defaults(spec: InferenceServiceSpec, defaults: CacheDefaults) -> InferenceServiceSpec:
    """The spec with its model cache settings complete (what the builders read)."""
    from kvpilot.operator.crd_types import ModelCacheSpec

    own = spec.model.cache or ModelCacheSpec()
    cache = ModelCacheSpec(mode=own.mode or defaults.mode, storage_class_name=own.storage_class_name or defaults.storage_class_name,
                           size=own.size or defaults.size)
    return spec.model_copy(update={"model": spec.model.model_copy(update={"cache": cache})})


def entry_key(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def claim_name(source: str) -> str:
    return f"kvpilot-model-{entry_key(source)}"


def cached_files(spec: InferenceServiceSpec) -> list[ModelFiles]:
    """The model files an entry holds (downloaded sources, the draft model too); none unless Shared."""
    return [f for f in model_files(spec) if f.cached]


def _owner(name: str, uid: str) -> dict:
    return {"apiVersion": f"{GROUP}/v1alpha1", "kind": "InferenceService", "name": name, "uid": uid, "blockOwnerDeletion": False}


def user_field_manager(uid: str) -> str:
    """Each InferenceService applies its own ownerReference on a shared claim under its own manager:
    server-side apply keeps every manager's list items (merged by uid)."""
    return f"kvpilot-operator/{uid}"


def _claim(name: str, namespace: str, labels: dict, annotations: dict, access: str, size: str, storage_class: str | None,
           existing: dict | None, owner: dict | None) -> dict:
    """A claim as this user applies it: an existing claim's spec as it is (claims are immutable, and
    another user's defaults may differ), our ownerReference (none: this user lets go of it)."""
    spec = {"accessModes": [access], "resources": {"requests": {"storage": size}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    if existing is not None:
        spec = {k: existing["spec"][k] for k in ("accessModes", "resources", "storageClassName") if k in existing["spec"]}
        spec["resources"] = {"requests": existing["spec"]["resources"]["requests"]}
    meta = {"name": name, "namespace": namespace, "labels": {**labels, MANAGED_BY[0]: MANAGED_BY[1]}, "annotations": annotations}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def entry_claim(source: str, namespace: str, spec: InferenceServiceSpec, user: tuple[str, str] | None, existing: dict | None) -> dict:
    """user: (name, uid) of the InferenceService that uses the entry; None to let go of it."""
    cache = spec.model.cache
    return _claim(claim_name(source), namespace, {ENTRY_LABEL: entry_key(source)}, {SOURCE_ANNOTATION: source}, "ReadWriteMany",
                  cache.size, cache.storage_class_name, existing, _owner(*user) if user else None)


def compile_cache_claim(namespace: str, spec: InferenceServiceSpec, defaults: CacheDefaults, user: tuple[str, str] | None,
                        existing: dict | None) -> dict:
    return _claim(COMPILE_CACHE_CLAIM, namespace, {}, {}, "ReadWriteMany", defaults.compile_cache_size, spec.model.cache.storage_class_name,
                  existing, _owner(*user) if user else None)


def fill_job(files: ModelFiles, namespace: str, spec: InferenceServiceSpec, claim: dict, env: list[dict]) -> dict:
    """The loader: `kvpilot fetch-model SOURCE /entry/NAME` into the claim, as the engine image's
    non-root user, retried by the Job controller; owned by the claim, and gone 15 s after it ends.
    Its termination message is the fetch summary (revision, bytes) or the error."""
    key = entry_key(files.source)
    image = kvpilot_image(spec)
    owner = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "name": claim["metadata"]["name"], "uid": claim["metadata"]["uid"],
             "controller": True, "blockOwnerDeletion": True}
    container = {"name": "fill", "image": image, "command": ["kvpilot", "fetch-model"],
                 "args": [files.source, f"{ENTRY_DIR}/{files.file_name}", "--timeout", str(FILL_TIMEOUT_SECONDS)],
                 "env": [*CACHE_ENV, *env], "securityContext": CONTAINER_SECURITY_CONTEXT,
                 "volumeMounts": [{"name": "entry", "mountPath": ENTRY_DIR}, {"name": "cache", "mountPath": CACHE_DIR}]}
    labels = {ENTRY_LABEL: key, MANAGED_BY[0]: MANAGED_BY[1]}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{claim['metadata']['name']}-fill", "namespace": namespace, "labels": labels, "ownerReferences": [owner]},
            "spec": {"backoffLimit": FILL_BACKOFF_LIMIT, "activeDeadlineSeconds": FILL_TIMEOUT_SECONDS * 2, "ttlSecondsAfterFinished": FILL_JOB_TTL_SECONDS,
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"restartPolicy": "Never", "containers": [container], "securityContext": POD_SECURITY_CONTEXT,
                                           "automountServiceAccountToken": False, "enableServiceLinks": False,
                                           **({"imagePullSecrets": image_pull_secrets()} if image_pull_secrets() else {}),
                                           "volumes": [{"name": "entry", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}},
                                                       {"name": "cache", "emptyDir": {}}]}}}}


def filled_annotations(message: str, when: str) -> dict[str, str] | None:
    """The claim's record of a successful fill, from the loader's termination message (fetch-model's
    JSON summary); None when the message is not one."""
    try:
        summary = json.loads(message)
        revision, size = summary.get("revision"), int(summary["bytes"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return {REVISION_ANNOTATION: revision or "", BYTES_ANNOTATION: str(size), FILLED_ANNOTATION: when}


def entry_state(claim: dict | None, loader_pods: list[dict]) -> tuple[str, str | None, int | None, str | None]:
    """(state, revision, bytes, message) of an entry: Ready once its fill is recorded on the claim;
    Failed while its newest loader pod has failed (the Job retries: Filling again once a new pod
    runs); Filling otherwise."""
    annotations = ((claim or {}).get("metadata") or {}).get("annotations") or {}
    if FILLED_ANNOTATION in annotations:
        return "Ready", annotations.get(REVISION_ANNOTATION) or None, int(annotations.get(BYTES_ANNOTATION, 0)), None
    newest = max(loader_pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", default=None)
    if newest is not None and (newest.get("status") or {}).get("phase") == "Failed":
        return "Failed", None, None, termination_message(newest) or "the loader failed (no message)"
    return "Filling", None, None, None


def termination_message(pod: dict) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated") or {}
        if terminated.get("message"):
            return terminated["message"].strip()
    return ""
