"""spec.podTemplate: a strategic-merge patch over the engine pods' spec (KServe offers a PodSpec, KubeAI patches), for what the
InferenceService has no field for — affinity, priorityClassName, runtimeClassName, extra volumes and mounts, envFrom, sidecars.

The merge is Kubernetes' strategic merge for a pod spec: maps merge key by key; the lists Kubernetes merges by a key merge
item by item on it (containers, initContainers, volumes, env, imagePullSecrets by name; ports by containerPort and protocol;
volumeMounts by mountPath; topologySpreadConstraints by topologyKey and whenUnsatisfiable), a new item appended; tolerations
are added to the operator's (a GPU pod keeps its GPU toleration); every other list is replaced. A container the patch adds
starts from the engine container's security context.

What the operator's pods depend on is refused (a Degraded condition, nothing applied), checked on the patch and on the pod it
makes: nulls and `$patch` directives; the security context may only be made stricter (Pod Security "restricted" and the
operator's own: non-root, no privilege escalation, all capabilities dropped, a read-only root filesystem, the runtime's
seccomp profile, no unconfined AppArmor or SELinux type); the engine container's command, args and image (the image is
spec.image) and the variables the operator sets; the pod's identity (service account, its token) and node; host namespaces;
volumes other than the pod-scoped kinds."""

from __future__ import annotations

import copy
from typing import Any

from kvpilot.operator.builders.pod_defaults import CONTAINER_SECURITY_CONTEXT
from kvpilot.operator.crd_types import RESERVED_ENV

MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",), "initContainers": ("name",), "volumes": ("name",), "env": ("name",), "imagePullSecrets": ("name",),
    "ports": ("containerPort", "protocol"), "volumeMounts": ("mountPath",), "topologySpreadConstraints": ("topologyKey", "whenUnsatisfiable"),
}
APPENDED = {"tolerations"}
# The pod's security context: what may be set (the rest — the user, non-root, seccomp — is the operator's).
POD_SECURITY_FIELDS = {"fsGroup", "fsGroupChangePolicy", "supplementalGroups"}
REFUSED_POD_FIELDS = ("hostNetwork", "hostPID", "hostIPC", "hostUsers", "serviceAccountName", "serviceAccount", "automountServiceAccountToken",
                      "nodeName", "ephemeralContainers", "shareProcessNamespace")
VOLUME_KINDS = {"configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected", "downwardAPI", "ephemeral", "csi", "image"}
ENGINE_CONTAINER = "engine"
OPERATOR_ENV = {*RESERVED_ENV, "UCX_TCP_PORT_RANGE", "OMP_WAIT_POLICY"}  # (UCX's: the KV data ports the NetworkPolicy closes)
SELINUX_TYPES = {"container_t", "container_init_t", "container_kvm_t"}


def _key(item: dict, keys: tuple[str, ...]) -> tuple:
    return tuple(item.get(k, "TCP" if k == "protocol" else None) for k in keys)


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v, k) if k in base else _new(k, v)
        return out
    if field in MERGE_KEYS and isinstance(base, list) and isinstance(patch, list):
        keys, out = MERGE_KEYS[field], [copy.deepcopy(i) for i in base]
        for item in patch:
            at = next((n for n, b in enumerate(out) if _key(b, keys) == _key(item, keys)), None)
            if at is None:
                out.append(_new(field, item, single=True))
            else:
                out[at] = strategic_merge(out[at], item)
        return out
    if field in APPENDED and isinstance(base, list) and isinstance(patch, list):
        return copy.deepcopy(base) + [copy.deepcopy(i) for i in patch if i not in base]
    return copy.deepcopy(patch)


def _new(field: str, value: Any, single: bool = False) -> Any:
    """What the patch adds: a container starts from the engine container's security context."""
    if field in ("containers", "initContainers"):
        items = [value] if single else value
        made = [strategic_merge({"securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT)}, c) if isinstance(c, dict) else c for c in items]
        return made[0] if single else made
    return copy.deepcopy(value)


def _walk(value: Any, path: str):
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(value, list):
        for n, v in enumerate(value):
            yield from _walk(v, f"{path}[{n}]")


def patch_problems(patch: dict) -> list[str]:
    """What in spec.podTemplate.spec itself the operator refuses."""
    problems = []
    for path, value in _walk(patch, "podTemplate.spec"):
        if value is None:
            problems.append(f"{path}: null is not allowed (a field is left out, not removed)")
        if isinstance(value, dict):
            problems += [f"{path}.{k}: patch directives are not allowed" for k in value if k.startswith("$")]
    problems += [f"podTemplate.spec.{f} is not allowed (the pod's identity, node and namespaces are the operator's)"
                 for f in REFUSED_POD_FIELDS if f in patch]
    if set(patch.get("securityContext") or {}) - POD_SECURITY_FIELDS:
        problems.append(f"podTemplate.spec.securityContext may set only {', '.join(sorted(POD_SECURITY_FIELDS))}")
    for field, keys in MERGE_KEYS.items():
        for where, items in [("podTemplate.spec", patch.get(field))] + [
                (f"podTemplate.spec.{lst}[{c.get('name')}]", c.get(field)) for lst in ("containers", "initContainers")
                for c in patch.get(lst) or [] if isinstance(c, dict)]:
            for item in items or []:
                if not isinstance(item, dict) or any(item.get(k) is None for k in keys if k != "protocol"):
                    problems.append(f"{where}.{field}: every item needs {' and '.join(k for k in keys if k != 'protocol')} (they merge on it)")
    for v in patch.get("volumes") or []:
        if isinstance(v, dict) and not set(v) - {"name"} <= VOLUME_KINDS:
            problems.append(f"podTemplate.spec.volumes[{v.get('name')}]: only {', '.join(sorted(VOLUME_KINDS))} volumes")
    for c in patch.get("containers") or []:
        if isinstance(c, dict) and c.get("name") == ENGINE_CONTAINER:
            where = f"podTemplate.spec.containers[{ENGINE_CONTAINER}]"
            problems += [f"{where}.{f} is the operator's (the engine's command line; the image is spec.image)"
                         for f in ("command", "args", "image") if f in c]
            problems += [f"{where}.env[{e.get('name')}] is set by the operator" for e in c.get("env") or []
                         if isinstance(e, dict) and e.get("name") in OPERATOR_ENV]
    return problems


def _container_problems(where: str, sc: dict) -> list[str]:
    problems = []
    if sc.get("privileged") or sc.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{where}: privileges must stay off (allowPrivilegeEscalation false, not privileged)")
    if sc.get("runAsNonRoot") is False or sc.get("runAsUser") == 0 or sc.get("runAsGroup") == 0:
        problems.append(f"{where}: may not run as root")
    if sc.get("readOnlyRootFilesystem") is not True:
        problems.append(f"{where}: the root filesystem stays read-only")
    caps = sc.get("capabilities") or {}
    if caps.get("add") or "ALL" not in (caps.get("drop") or []):
        problems.append(f"{where}: every capability stays dropped (none added)")
    if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined" or (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        problems.append(f"{where}: AppArmor and seccomp stay confined")
    if (sc.get("seLinuxOptions") or {}).get("type") not in (None, *SELINUX_TYPES):
        problems.append(f"{where}: SELinux type must be one of {', '.join(sorted(SELINUX_TYPES))}")
    return problems


def pod_problems(pod_spec: dict) -> list[str]:
    """The pod the patch makes, held to what the operator's own pods are: Pod Security "restricted" and more."""
    sc = pod_spec.get("securityContext") or {}
    problems = []
    if sc.get("runAsNonRoot") is not True or sc.get("runAsUser") == 0 or (sc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        problems.append("podTemplate: the pod's security context (non-root, RuntimeDefault seccomp) is the operator's")
    for lst in ("containers", "initContainers"):
        for c in pod_spec.get(lst) or []:
            problems += _container_problems(f"podTemplate: {lst}[{c.get('name')}].securityContext", c.get("securityContext") or {})
    return problems
