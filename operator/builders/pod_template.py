"""spec.podTemplate: a strategic-merge patch over the engine pods' spec (KServe offers a PodSpec, KubeAI patches), for what the
InferenceService has no field for — affinity, priorityClassName, runtimeClassName, extra volumes and mounts, envFrom, sidecars.

The merge is Kubernetes' strategic merge for a pod spec: maps merge key by key; the lists Kubernetes merges by name
(containers, initContainers, volumes, and in a container env, volumeMounts, ports) merge item by item, a new name appended;
every other list is replaced. What the operator's pods depend on is refused (a Degraded condition, nothing applied): the
security context may only be added to, never weakened; the engine container's command, args and image are the operator's (the
image is spec.image); no host namespaces and no hostPath volumes."""

from __future__ import annotations

import copy
from typing import Any

MERGED_BY_NAME = {"containers", "initContainers", "ephemeralContainers", "volumes", "env", "volumeMounts", "ports", "imagePullSecrets"}
# The pod's security context: what may be set (the rest — the user, non-root, seccomp — is the operator's).
POD_SECURITY_FIELDS = {"fsGroup", "fsGroupChangePolicy", "supplementalGroups", "seLinuxOptions"}
HOST_FIELDS = ("hostNetwork", "hostPID", "hostIPC", "hostUsers")
ENGINE_CONTAINER = "engine"


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if key in MERGED_BY_NAME and isinstance(base, list) and isinstance(patch, list) and all(isinstance(i, dict) and "name" in i for i in patch):
        out = [copy.deepcopy(i) for i in base]
        for item in patch:
            at = next((n for n, b in enumerate(out) if isinstance(b, dict) and b.get("name") == item["name"]), None)
            if at is None:
                out.append(copy.deepcopy(item))
            else:
                out[at] = strategic_merge(out[at], item)
        return out
    return copy.deepcopy(patch)


def _container_problems(where: str, c: dict) -> list[str]:
    problems = []
    sc = c.get("securityContext") or {}
    if not isinstance(sc, dict):
        return [f"{where}.securityContext must be an object"]
    if sc.get("privileged") or sc.get("allowPrivilegeEscalation") is True:
        problems.append(f"{where}.securityContext may not allow privileges (privileged, allowPrivilegeEscalation)")
    if sc.get("runAsNonRoot") is False or sc.get("runAsUser") == 0 or sc.get("runAsGroup") == 0:
        problems.append(f"{where}.securityContext may not run as root")
    if sc.get("readOnlyRootFilesystem") is False:
        problems.append(f"{where}.securityContext may not make the root filesystem writable")
    if (sc.get("capabilities") or {}).get("add"):
        problems.append(f"{where}.securityContext may not add capabilities")
    if "seccompProfile" in sc or "procMount" in sc:
        problems.append(f"{where}.securityContext.seccompProfile and procMount are the operator's")
    return problems


def pod_template_problems(patch: dict) -> list[str]:
    """What in spec.podTemplate.spec the operator refuses (each a sentence naming the field)."""
    problems = [f"podTemplate.spec.{f} is not allowed (the engine pods share no host namespace)" for f in HOST_FIELDS if patch.get(f)]
    pod_sc = patch.get("securityContext") or {}
    if not isinstance(pod_sc, dict) or set(pod_sc) - POD_SECURITY_FIELDS:
        problems.append(f"podTemplate.spec.securityContext may set only {', '.join(sorted(POD_SECURITY_FIELDS))} (the user, non-root "
                        "and seccomp settings are the operator's)")
    for v in patch.get("volumes") or []:
        if isinstance(v, dict) and "hostPath" in v:
            problems.append(f"podTemplate.spec.volumes[{v.get('name')}]: hostPath volumes are not allowed")
    for list_name in ("containers", "initContainers", "ephemeralContainers"):
        for c in patch.get(list_name) or []:
            if not isinstance(c, dict) or "name" not in c:
                problems.append(f"podTemplate.spec.{list_name}: every container needs a name (containers merge by name)")
                continue
            where = f"podTemplate.spec.{list_name}[{c['name']}]"
            problems += _container_problems(where, c)
            if list_name == "containers" and c["name"] == ENGINE_CONTAINER:
                problems += [f"{where}.{f} is the operator's (the engine's command line; the image is spec.image)"
                             for f in ("command", "args", "image") if f in c]
    return problems
