"""InferenceService -> Deployment, Service, PodDisruptionBudget, PodMonitor, and for a disaggregated service its KV transfer
Secret and NetworkPolicy. Pure functions of the spec."""

from __future__ import annotations

from kvpilot.operator.builders.engines import (
    KV_DATA_PORTS,
    KV_TIER_DIR,
    KV_TRANSFER_PORT,
    LORA_DIR,
    PORT,
    SHUTDOWN_GRACE_SECONDS,
    EngineContainer,
    adapter_claims,
    engine_container,
    image_pull_secrets,
    kvpilot_image,
    model_files,
    shared_cache,
)
from kvpilot.operator.builders.model_cache import COMPILE_CACHE_CLAIM, COMPILE_CACHE_DIR, claim_name
from kvpilot.operator.builders.pod_defaults import CACHE_DIR, CACHE_ENV, CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT
from kvpilot.operator.builders.pod_template import strategic_merge
from kvpilot.operator.crd_types import GROUP, ISVC_LABEL, KIND, MANAGED_BY, ROLE_LABEL, VERSION, EnvVar, InferenceServiceSpec, ResourceSpec, SecretKeyRef
from kvpilot.server.model_source import parse_model_source

ENGINE_LABEL = f"{GROUP}/engine"
# A group's pods (resources.gpusPerPod below the engine's GPUs): "leader" (serves the API, counted, routed to) or "worker".
GROUP_POD_LABEL = f"{GROUP}/group-pod"
LWS_API = "leaderworkerset.x-k8s.io/v1"
# A disaggregated service's prefill and decode engines read their shared key from this variable (the engine's own name
# for it: never a flag, so it is in neither `ps` nor logs); the Secret <name>-kv-transfer holds it under this key.
KV_TRANSFER_SECRET_ENV = "KVPILOT_KV_TRANSFER_SECRET"
KV_TRANSFER_SECRET_KEY = "key"
STARTUP_BUDGET_SECONDS = 1800  # model download + load on a cold node
DOWNLOAD_TIMEOUT_SECONDS = 1500


def selector_labels(name: str) -> dict[str, str]:
    """Every engine pod of the service: of a disaggregated one, its prefill pods too (they also carry ROLE_LABEL prefill).
    The main Deployment's selector (immutable: it stays what it was when disaggregation is turned on or off)."""
    return {ISVC_LABEL: name}


def is_prefill_pod(pod: dict) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL) == "prefill"


def is_group_worker(pod: dict) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(GROUP_POD_LABEL) == "worker"


def is_ready(pod: dict) -> bool:
    """Whether the pod's Ready condition is True (its readiness probe passes: the engine serves)."""
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in (pod.get("status") or {}).get("conditions") or [])


def is_reachable_and_ready(pod: dict) -> bool:
    """Whether requests may go to the pod now: Ready, with an IP, and not terminating (a pod being deleted stays Ready
    until its engine drains)."""
    return not (pod.get("metadata") or {}).get("deletionTimestamp") and bool((pod.get("status") or {}).get("podIP")) and is_ready(pod)


def serving_pods(pods: list[dict]) -> list[dict]:
    """The pods the service's own status, scale subresource and autoscaler count: all but a prefill pool's and a group's
    workers (a group is its leader: the pod that serves, and exports the metrics)."""
    return [p for p in pods if not is_prefill_pod(p) and not is_group_worker(p)]


def group_name(name: str) -> str:
    """The LeaderWorkerSet of a service whose replicas are groups of pods. Not the service's own name: LeaderWorkerSet makes a
    headless Service of its name for the pods' addresses (LWS_LEADER_ADDRESS), beside the service's own Service."""
    return f"{name}-group"


def prefill_name(name: str) -> str:
    """The prefill pool's Deployment and PodDisruptionBudget."""
    return f"{name}-prefill"


def prefill_selector(name: str) -> dict[str, str]:
    return {ISVC_LABEL: name, ROLE_LABEL: "prefill"}


def pod_selector(name: str, spec: InferenceServiceSpec | None) -> dict[str, str]:
    """The service's own pods as a label selector (status.selector, the Service): a disaggregated service's decode pods."""
    if spec is not None and spec.group_size > 1:
        return {ISVC_LABEL: name, GROUP_POD_LABEL: "leader"}
    return {ISVC_LABEL: name, ROLE_LABEL: "decode"} if spec is not None and spec.disaggregation else selector_labels(name)


def common_labels(name: str, spec: InferenceServiceSpec | None = None) -> dict[str, str]:
    labels = {**selector_labels(name), MANAGED_BY[0]: MANAGED_BY[1], "app.kubernetes.io/name": "kvpilot-engine",
              "app.kubernetes.io/instance": name}
    if spec is not None:
        labels[ENGINE_LABEL] = spec.engine
    return labels


def owner_reference(name: str, uid: str) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name, "uid": uid, "controller": True, "blockOwnerDeletion": True}


def _meta(name: str, namespace: str, uid: str, spec: InferenceServiceSpec) -> dict:
    return {"name": name, "namespace": namespace, "labels": common_labels(name, spec), "ownerReferences": [owner_reference(name, uid)]}


def desired_replicas(spec: InferenceServiceSpec) -> int:
    return spec.replicas if spec.replicas is not None else spec.min_replicas


def desired_prefill_replicas(spec: InferenceServiceSpec) -> int:
    pool = spec.disaggregation.prefill
    return pool.replicas if pool.replicas is not None else pool.min_replicas


def _model_volumes(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict], list[dict]]:
    """Volumes, mounts and init containers that put each model file (the served model, a draft
    model) where the engine reads it."""
    volumes, mounts, inits = [], [], []
    for files in model_files(spec):
        src = parse_model_source(files.source)
        if src.kind == "pvc":
            volumes.append({"name": files.volume, "persistentVolumeClaim": {"claimName": src.name, "readOnly": True}})
            mounts.append({"name": files.volume, "mountPath": f"{files.directory}/pvc", "readOnly": True})
        elif files.cached:  # the model cache entry, filled before the Deployment is applied
            volumes.append({"name": files.volume, "persistentVolumeClaim": {"claimName": claim_name(files.source), "readOnly": True}})
            mounts.append({"name": files.volume, "mountPath": f"{files.directory}/cache", "readOnly": True})
        elif files.downloaded(spec.engine) is not None:
            mount = {"name": files.volume, "mountPath": f"{files.directory}/download"}
            # The kvpilot engine image downloads it: arguments as a list (no shell), as the same non-root user.
            inits.append({"name": f"download-{files.volume}", "image": kvpilot_image(spec),
                          "command": ["kvpilot", "fetch-model"],
                          "args": [src.raw, files.argument(spec.engine), "--timeout", str(DOWNLOAD_TIMEOUT_SECONDS),
                                   *(["--config-only"] if files.config_only else [])],
                          "env": [*CACHE_ENV, *hf_token_env(spec)],
                          "securityContext": CONTAINER_SECURITY_CONTEXT,
                          "volumeMounts": [mount, {"name": "cache", "mountPath": CACHE_DIR}]})
            volumes.append({"name": files.volume, "emptyDir": {}})
            mounts.append(mount)
    return volumes, mounts, inits


def _adapter_volumes(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    """With adapters: the writable LORA_DIR (hf:// adapters downloaded into it) and each adapter claim under it."""
    if not spec.adapters:
        return [], []
    volumes, mounts = [{"name": "adapters", "emptyDir": {}}], [{"name": "adapters", "mountPath": LORA_DIR}]
    for i, claim in enumerate(adapter_claims(spec)):
        volumes.append({"name": f"adapter-claim-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": f"adapter-claim-{i}", "mountPath": f"{LORA_DIR}/pvc/{claim}", "readOnly": True})
    return volumes, mounts


def _cache_env(spec: InferenceServiceSpec) -> list[dict]:
    """HOME and the caches on the pod's emptyDir; with the shared model cache, Triton's and torch's
    compile caches on the namespace's compile-cache claim."""
    if not shared_cache(spec):
        return CACHE_ENV
    return [*(e for e in CACHE_ENV if e["name"] != "TRITON_CACHE_DIR"), {"name": "TRITON_CACHE_DIR", "value": f"{COMPILE_CACHE_DIR}/triton"},
            {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{COMPILE_CACHE_DIR}/inductor"}]


def _secret_env(name: str, ref: SecretKeyRef) -> dict:
    """An env entry read from a Secret's key (the value never appears in the pod spec)."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def _env_entry(e: EnvVar) -> dict:
    """A user env entry as a container env entry: a value, or a reference to a Secret's key."""
    return _secret_env(e.name, e.value_from.secret_key_ref) if e.value_from is not None else {"name": e.name, "value": e.value}


def hf_token_env(spec: InferenceServiceSpec) -> list[dict]:
    """HF_TOKEN and HF_ENDPOINT from the user's env reach the download too (gated or mirrored hub files)."""
    return [_env_entry(e) for e in spec.env if e.name in ("HF_TOKEN", "HF_ENDPOINT")]


def _resources(spec: InferenceServiceSpec, r: ResourceSpec) -> dict:
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if not r.cpu_only:
        limits[r.gpu_resource] = str(r.gpus_per_pod or spec.engine_settings.gpus)
    if r.cpu:
        limits["cpu"] = requests["cpu"] = r.cpu
    if r.memory:
        limits["memory"] = requests["memory"] = r.memory
    out = {"limits": limits}
    if requests:
        out["requests"] = requests
    return out


def kv_tier_claim_name(name: str) -> str:
    return f"{name}-kv-tier"


def _kv_tier_volumes(name: str, spec: InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    tier = spec.engine_settings.kv_offload
    if tier is None or tier.mode == "Off" or spec.engine != "kvpilot":
        return [], []
    source = {"persistentVolumeClaim": {"claimName": kv_tier_claim_name(name)}} if tier.mode == "Shared" else {"emptyDir": {"sizeLimit": tier.size}}
    return [{"name": "kv-tier", **source}], [{"name": "kv-tier", "mountPath": KV_TIER_DIR}]


def kv_tier_claim(name: str, namespace: str, uid: str, spec: InferenceServiceSpec) -> dict | None:
    """The Shared disk tier's ReadWriteMany claim, owned by the InferenceService (deleted with it)."""
    tier = spec.engine_settings.kv_offload
    if tier is None or tier.mode != "Shared" or spec.engine != "kvpilot":
        return None
    claim_spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": tier.size}}}
    if tier.storage_class_name:
        claim_spec["storageClassName"] = tier.storage_class_name
    meta = _meta(name, namespace, uid, spec)
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {**meta, "name": kv_tier_claim_name(name)}, "spec": claim_spec}


def _probe_get(c: EngineContainer, path: str) -> dict:
    """A probe's httpGet; an engine serving TLS is probed over HTTPS (the kubelet does not verify its certificate)."""
    return {"path": path, "port": "http", **({"scheme": c.scheme} if c.scheme != "HTTP" else {})}


def pod_template(name: str, spec: InferenceServiceSpec, prefill: bool = False, group_pod: str | None = None) -> dict:
    """An engine pod: of the service's own pods (of a disaggregated service: its decode pool), or (prefill) of its prefill
    pool; group_pod: "leader" or "worker" of a group's (resources.gpusPerPod below the engine's GPUs)."""
    pool = "prefill" if prefill else "decode" if spec.disaggregation else None
    resources = (spec.disaggregation.prefill.resources if prefill else None) or spec.resources
    c = engine_container(spec, name, pool, worker=group_pod == "worker")
    volumes, mounts, inits = _model_volumes(spec)
    adapter_volumes, adapter_mounts = _adapter_volumes(spec) if not prefill else ([], [])
    volumes, mounts = volumes + adapter_volumes, mounts + adapter_mounts
    tier_volumes, tier_mounts = _kv_tier_volumes(name, spec)
    volumes, mounts = volumes + tier_volumes, mounts + tier_mounts
    compile_mounts = []
    if shared_cache(spec):  # compiled kernels outlive the pod: a warm start does not compile again
        volumes.append({"name": "compile-cache", "persistentVolumeClaim": {"claimName": COMPILE_CACHE_CLAIM}})
        compile_mounts.append({"name": "compile-cache", "mountPath": COMPILE_CACHE_DIR})
    # The user's entries come first: the names the operator sets last are reserved (the spec refuses them),
    # and Kubernetes lets a later entry of the same name win.
    env = [*(_env_entry(e) for e in spec.env),
           {"name": "OMP_WAIT_POLICY", "value": "PASSIVE"}, *c.env, *_cache_env(spec),
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    if spec.api_key_secret_ref is not None:
        env.append(_secret_env("KVPILOT_API_KEY", spec.api_key_secret_ref))
    if pool is not None:  # both pools: the prefill engine signs the kv_transfer_params it hands out, the decode engine checks them
        env.append(_secret_env(KV_TRANSFER_SECRET_ENV, SecretKeyRef(name=kv_transfer_name(name), key=KV_TRANSFER_SECRET_KEY)))
        # NIXL's data path (UCX) on ports the KV transfer NetworkPolicy closes to other pods: it carries no authentication
        env.append({"name": "UCX_TCP_PORT_RANGE", "value": f"{KV_DATA_PORTS[0]}-{KV_DATA_PORTS[1]}"})
    container = {
        "name": "engine", "image": c.image, "command": c.command, "args": c.args, "env": env,
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"},
                  *([{"name": "kv-transfer", "containerPort": KV_TRANSFER_PORT, "protocol": "TCP"}] if prefill else [])],
        "resources": _resources(spec, resources),
        **({"startupProbe": {"httpGet": _probe_get(c, c.health_path), "periodSeconds": 5, "failureThreshold": STARTUP_BUDGET_SECONDS // 5},
            "readinessProbe": {"httpGet": _probe_get(c, c.ready_path), "periodSeconds": 5, "failureThreshold": 3},
            "livenessProbe": {"httpGet": _probe_get(c, c.health_path), "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6}}
           if c.serves_http else {}),
        "volumeMounts": [*mounts, {"name": "shm", "mountPath": "/dev/shm"}, {"name": "cache", "mountPath": CACHE_DIR},
                         {"name": "tmp", "mountPath": "/tmp"}, *compile_mounts],
        "securityContext": CONTAINER_SECURITY_CONTEXT,
    }
    node_selector = dict(resources.node_selector)
    if resources.gpu_product and not resources.cpu_only:
        node_selector["nvidia.com/gpu.product"] = resources.gpu_product
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in resources.tolerations]
    if not resources.cpu_only:
        tolerations.append({"key": resources.gpu_resource, "operator": "Exists", "effect": "NoSchedule"})
    pod_labels = {**spec.pod_labels, **common_labels(name, spec), **({ROLE_LABEL: pool} if pool else {}),
                  **({GROUP_POD_LABEL: group_pod} if group_pod else {})}
    pod_annotations = dict(spec.pod_annotations)
    if group_pod != "worker":  # (a worker serves no metrics: its leader's engine counts the group's work)
        pod_annotations |= {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORT), "prometheus.io/path": "/metrics"}
    pod_spec = {
        "containers": [container],
        "volumes": [*volumes, {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
                    {"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
        "terminationGracePeriodSeconds": SHUTDOWN_GRACE_SECONDS + 15,  # the engine drains in-flight requests first
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # the engine never talks to the API server
        "securityContext": POD_SECURITY_CONTEXT,
    }
    if inits:
        pod_spec["initContainers"] = inits
    if pull_secrets := image_pull_secrets():
        pod_spec["imagePullSecrets"] = pull_secrets
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.pod_template is not None and spec.pod_template.spec:  # (checked by patch_problems and pod_problems before anything is applied)
        pod_spec = strategic_merge(pod_spec, spec.pod_template.spec)
    return {"metadata": {"labels": pod_labels, "annotations": pod_annotations}, "spec": pod_spec}


def deployment(name: str, namespace: str, uid: str, spec: InferenceServiceSpec, prefill: bool = False) -> dict:
    """The service's own pods (of a disaggregated service: its decode pool), or (prefill) its prefill pool."""
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {**_meta(name, namespace, uid, spec), **({"name": prefill_name(name)} if prefill else {})},
        "spec": {
            "replicas": desired_prefill_replicas(spec) if prefill else desired_replicas(spec),
            # The main Deployment's selector also matches the prefill pods: harmless (a ReplicaSet adopts only pods
            # without an owner), and it cannot change (immutable) when disaggregation is turned on or off.
            "selector": {"matchLabels": prefill_selector(name) if prefill else selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": pod_template(name, spec, prefill),
        },
    }


def leader_worker_set(name: str, namespace: str, uid: str, spec: InferenceServiceSpec) -> dict:
    """A service whose replicas are groups of pods (resources.gpusPerPod below the engine's GPUs): each replica a leader
    (serves the API; its ranks host the group's rendezvous) and group_size - 1 workers (their share of the ranks), made and
    numbered by LeaderWorkerSet. A failed pod recreates its whole group (the ranks cannot rejoin a running one); the workers
    start once the leader is created (its readiness waits for them: LeaderReady would never start them)."""
    return {
        "apiVersion": LWS_API, "kind": "LeaderWorkerSet",
        "metadata": {**_meta(name, namespace, uid, spec), "name": group_name(name)},
        "spec": {
            "replicas": desired_replicas(spec),
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0}},
            "leaderWorkerTemplate": {
                "size": spec.group_size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": pod_template(name, spec, group_pod="leader"),
                "workerTemplate": pod_template(name, spec, group_pod="worker"),
            },
        },
    }


def service(name: str, namespace: str, uid: str, spec: InferenceServiceSpec) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, namespace, uid, spec),
            "spec": {"selector": pod_selector(name, spec), "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}]}}


def pod_disruption_budget(name: str, namespace: str, uid: str, spec: InferenceServiceSpec, prefill: bool = False) -> dict:
    # No pod under two budgets (an eviction of such a pod is refused): the service's own leaves the prefill pool to its own.
    selector = {"matchLabels": prefill_selector(name)} if prefill else {
        "matchLabels": selector_labels(name), "matchExpressions": [{"key": ROLE_LABEL, "operator": "NotIn", "values": ["prefill"]}]}
    meta = _meta(name, namespace, uid, spec)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {**meta, "name": prefill_name(name)} if prefill else meta,
            "spec": {"selector": selector, "maxUnavailable": 1}}


def kv_transfer_name(name: str) -> str:
    """A disaggregated service's KV transfer Secret and NetworkPolicy."""
    return f"{name}-kv-transfer"


def kv_transfer_secret(name: str, namespace: str, uid: str, spec: InferenceServiceSpec, key: str) -> dict:
    """The key a disaggregated service's prefill and decode engines share (`key`: random, made by the caller). Created once,
    never applied over: a new key would fail every handoff between a pod started before it and one started after. Immutable
    for the same reason (an edit would split the pools). To rotate it, delete it and restart both pools: the reconcile the
    restart sets off makes a new one (pods that start before it wait for it)."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {**_meta(name, namespace, uid, spec), "name": kv_transfer_name(name)},
            "type": "Opaque", "immutable": True, "stringData": {KV_TRANSFER_SECRET_KEY: key}}


def kv_transfer_network_policy(name: str, namespace: str, uid: str, spec: InferenceServiceSpec) -> dict:
    """A disaggregated service's KV transfer port and NIXL's data ports (KV_DATA_PORTS, right after it: UCX's reads carry
    no authentication) reachable from its own engine pods alone (decode pods pull from prefill pods; any other client is
    refused), every other port of its pods open to all as before (the gateway, Prometheus).

    A NetworkPolicy only allows, and a pod it selects is closed to what none allows: so the second rule names every other
    TCP port, as the two ranges around the KV ports, and the HTTP port on its own too (on a network plugin that
    does not implement endPort a range reads as its first port alone: the HTTP port must not depend on it). The engine
    serves TCP alone (one container, the operator's); replies to the pod's own UDP requests (DNS) are not ingress.
    Kubelet probes come from the node, which most network plugins let through whatever the policy; they probe the HTTP
    port, which is open to all anyway."""
    engine_pods = {"matchLabels": selector_labels(name)}  # both pools
    every_other_port = [{"protocol": "TCP", "port": PORT}, {"protocol": "TCP", "port": 1, "endPort": KV_TRANSFER_PORT - 1},
                        {"protocol": "TCP", "port": KV_DATA_PORTS[1] + 1, "endPort": 65535}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {**_meta(name, namespace, uid, spec), "name": kv_transfer_name(name)},
            "spec": {"podSelector": engine_pods, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": engine_pods}], "ports": [{"protocol": "TCP", "port": KV_TRANSFER_PORT},
                                                                                   {"protocol": "TCP", "port": KV_DATA_PORTS[0],
                                                                                    "endPort": KV_DATA_PORTS[1]}]},
                                 {"ports": every_other_port}]}}


def _meta_label(label: str) -> str:
    """Prometheus's pod discovery's name of a pod label."""
    return "__meta_kubernetes_pod_label_" + label.replace(".", "_").replace("/", "_").replace("-", "_")


# The labels the autoscaler's PromQL selects on (operator/autoscaler/promql.py): namespace, pod,
# inferenceservice and role (prefill or decode; absent for a service that is not disaggregated). The chart's
# PodMonitor and the e2e Prometheus use these same rules.
METRICS_RELABELINGS = [
    {"sourceLabels": [_meta_label(ISVC_LABEL)], "targetLabel": "inferenceservice"},
    {"sourceLabels": [_meta_label(ROLE_LABEL)], "targetLabel": "role"},
    {"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "namespace"},
    {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "pod"},
]


def pod_monitor(name: str, namespace: str, uid: str, spec: InferenceServiceSpec) -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": _meta(name, namespace, uid, spec),
            "spec": {"selector": {"matchLabels": selector_labels(name),
                                  "matchExpressions": [{"key": GROUP_POD_LABEL, "operator": "NotIn", "values": ["worker"]}]},
                     "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": "15s", "relabelings": METRICS_RELABELINGS}]}}


def endpoint_url(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc:{PORT}/v1"


def render(name: str, namespace: str, uid: str, spec: InferenceServiceSpec, with_pod_monitor: bool = False,
           with_kv_transfer_policy: bool = True) -> list[dict]:
    """Every object an InferenceService owns that is applied on each reconcile, in apply order (not the KV transfer Secret,
    created once: `kv_transfer_secret`). with_kv_transfer_policy: the operator's setting (the chart's
    networkPolicy.kvTransfer.enabled)."""
    claim = kv_tier_claim(name, namespace, uid, spec)
    # Before the Deployments: no prefill pod serves its KV transfer port before the policy guards it.
    policy = kv_transfer_network_policy(name, namespace, uid, spec) if spec.disaggregation and with_kv_transfer_policy else None
    pods = leader_worker_set(name, namespace, uid, spec) if spec.group_size > 1 else deployment(name, namespace, uid, spec)
    objs = [*([claim] if claim else []), *([policy] if policy else []), pods, service(name, namespace, uid, spec),
            pod_disruption_budget(name, namespace, uid, spec)]
    if spec.disaggregation:
        objs += [deployment(name, namespace, uid, spec, prefill=True), pod_disruption_budget(name, namespace, uid, spec, prefill=True)]
    if with_pod_monitor:
        objs.append(pod_monitor(name, namespace, uid, spec))
    return objs
