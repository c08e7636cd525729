"""The local control plane is the real thing: version, CEL validation, subresources, controllers,
scheduler, kwok GPU nodes with loopback pod IPs, helm, Prometheus discovery."""

from __future__ import annotations

import json
import os
import socket
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from e2e.cluster import TOKEN, Cluster, versions
from e2e.conftest import start_prometheus
from e2e.net import NotLoopbackError, port_open, require_loopback
from e2e.waiting import wait_until

pytestmark = pytest.mark.cluster


def kget(cluster, *args):
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def test_version_is_real(cluster):
    want = versions()["K8S_VERSION"]
    assert cluster.api("/version")["gitVersion"] == want
    out = cluster.kubectl("version", "-o", "json").stdout
    assert json.loads(out)["serverVersion"]["gitVersion"] == want
    assert want.startswith("v1.36.")


WIDGET_CRD = textwrap.dedent("""
    apiVersion: apiextensions.k8s.io/v1
    kind: CustomResourceDefinition
    metadata: {name: widgets.test.kvpilot.dev}
    spec:
      group: test.kvpilot.dev
      scope: Namespaced
      names: {plural: widgets, singular: widget, kind: Widget}
      versions:
      - name: v1
        served: true
        storage: true
        subresources:
          status: {}
          scale: {specReplicasPath: .spec.replicas, statusReplicasPath: .status.replicas}
        schema:
          openAPIV3Schema:
            type: object
            properties:
              spec:
                type: object
                x-kubernetes-validations:
                - {rule: "self.minReplicas <= self.maxReplicas", message: "minReplicas must be <= maxReplicas"}
                properties:
                  replicas: {type: integer}
                  minReplicas: {type: integer}
                  maxReplicas: {type: integer}
              status:
                type: object
                properties:
                  replicas: {type: integer}
                  phase: {type: string}
    """)


def widget(name, lo, hi):
    return json.dumps({"apiVersion": "test.kvpilot.dev/v1", "kind": "Widget", "metadata": {"name": name},
                       "spec": {"replicas": 1, "minReplicas": lo, "maxReplicas": hi}})


def test_crd_cel_rule_and_subresources(cluster, namespace):
    cluster.kubectl("apply", "-f", "-", input=WIDGET_CRD)
    wait_until(lambda: cluster.kubectl("get", "crd", "widgets.test.kvpilot.dev", "-o", "jsonpath={.status.conditions[?(@.type=='Established')].status}").stdout == "True",
               what="CRD established")
    bad = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget("bad", 5, 2), check=False)
    assert bad.returncode != 0 and "minReplicas must be <= maxReplicas" in bad.stderr
    wait_until(lambda: cluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget("good", 1, 3)), what="valid widget accepted")
    # status subresource: a status patch lands, a spec change through /status does not
    cluster.kubectl("patch", "widget", "good", "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"phase": "Ready", "replicas": 1}, "spec": {"replicas": 9}}))
    w = kget(cluster, "widget", "good", "-n", namespace)
    assert w["status"]["phase"] == "Ready" and w["spec"]["replicas"] == 1
    # scale subresource
    cluster.kubectl("scale", "widget", "good", "-n", namespace, "--replicas=3")
    assert kget(cluster, "widget", "good", "-n", namespace)["spec"]["replicas"] == 3
    scale = cluster.api(f"/apis/test.kvpilot.dev/v1/namespaces/{namespace}/widgets/good/scale")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 1


def gpu_deployment(name, replicas, gpus=1):
    return json.dumps({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
                       "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                                "template": {"metadata": {"labels": {"app": name}},
                                             "spec": {"containers": [{"name": "c", "image": "example/gpu:1",
                                                                      "resources": {"limits": {"nvidia.com/gpu": gpus}}}]}}}})


def running_ready_pods(cluster, namespace, app):
    pods = kget(cluster, "pods", "-n", namespace, "-l", f"app={app}")["items"]
    ready = [p for p in pods if p["status"].get("phase") == "Running" and p.get("metadata", {}).get("deletionTimestamp") is None
             and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
    return pods, ready


def test_gpu_deployment_scheduled_on_gpu_nodes_and_scales(cluster, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=gpu_deployment("llm", 2))
    wait_until(lambda: len(running_ready_pods(cluster, namespace, "llm")[1]) == 2, timeout=60, what="2 ready GPU pods")
    rs = kget(cluster, "replicasets", "-n", namespace, "-l", "app=llm")["items"]
    assert len(rs) == 1 and rs[0]["status"]["readyReplicas"] == 2  # the real controller manager made it
    _, ready = running_ready_pods(cluster, namespace, "llm")
    for p in ready:
        assert p["spec"]["nodeName"].startswith("gpu-node-")
        require_loopback(p["status"]["podIP"])
    cluster.kubectl("scale", "deployment", "llm", "-n", namespace, "--replicas=5")
    wait_until(lambda: len(running_ready_pods(cluster, namespace, "llm")[1]) == 5, timeout=60, what="5 ready pods")
    assert all(p["spec"]["nodeName"].startswith("gpu-node-") for p in running_ready_pods(cluster, namespace, "llm")[1])
    assert len({p["status"]["podIP"] for p in running_ready_pods(cluster, namespace, "llm")[1]}) == 5
    cluster.kubectl("scale", "deployment", "llm", "-n", namespace, "--replicas=1")
    wait_until(lambda: len(running_ready_pods(cluster, namespace, "llm")[0]) == 1, timeout=60, what="scaled down to 1 pod")


def test_pod_asking_too_many_gpus_stays_pending_with_reason(cluster, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=gpu_deployment("huge", 1, gpus=16))

    def pending_reason():
        pods = kget(cluster, "pods", "-n", namespace, "-l", "app=huge")["items"]
        if not pods:
            return None
        cond = [c for c in pods[0]["status"].get("conditions", []) if c["type"] == "PodScheduled"]
        return pods[0]["status"]["phase"] == "Pending" and cond and cond[0]["status"] == "False" and cond[0].get("message")

    message = wait_until(pending_reason, timeout=30, what="PodScheduled=False")
    assert "Insufficient nvidia.com/gpu" in message


def test_engine_pods_ready_only_with_annotation(cluster, namespace):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "engine", "labels": {"serving.kvpilot.dev/inferenceservice": "demo"}},
           "spec": {"containers": [{"name": "engine", "image": "kvpilot/engine:dev"}]}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))

    def state():
        p = kget(cluster, "pod", "engine", "-n", namespace)
        ready = next((c["status"] for c in p["status"].get("conditions", []) if c["type"] == "Ready"), None)
        return p["status"].get("phase"), ready, p["status"].get("podIP")

    wait_until(lambda: state()[0] == "Running", what="engine pod Running")
    phase, ready, ip = state()
    assert ready == "False" and require_loopback(ip)
    import time

    time.sleep(2)
    assert state()[1] == "False"  # nothing makes it Ready on its own
    cluster.kubectl("annotate", "pod", "engine", "-n", namespace, "serving.kvpilot.dev/engine-ready=true")
    wait_until(lambda: state()[1] == "True", what="Ready after the annotation")
    cluster.kubectl("annotate", "pod", "engine", "-n", namespace, "serving.kvpilot.dev/engine-ready-")
    wait_until(lambda: state()[1] == "False", what="NotReady once the annotation is gone")


def test_helm_install_upgrade_uninstall(cluster, namespace, tmp_path):
    chart = tmp_path / "demo"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: demo\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\ndata:\n  greeting: {{ .Values.greeting | quote }}\n")
    cluster.helm("install", "rel", str(chart), "-n", namespace, "--wait", "--timeout", "60s")
    assert kget(cluster, "configmap", "rel-cm", "-n", namespace)["data"]["greeting"] == "hello"
    cluster.helm("upgrade", "rel", str(chart), "-n", namespace, "--set", "greeting=bonjour")
    assert kget(cluster, "configmap", "rel-cm", "-n", namespace)["data"]["greeting"] == "bonjour"
    history = cluster.helm("history", "rel", "-n", namespace, "-o", "json").stdout
    assert [h["revision"] for h in json.loads(history)] == [1, 2]
    cluster.helm("uninstall", "rel", "-n", namespace)
    assert cluster.kubectl("get", "configmap", "rel-cm", "-n", namespace, check=False).returncode != 0


class _Metrics(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body if self.path == "/metrics" else b"")

    def log_message(self, *args):
        pass


def test_prometheus_discovers_and_scrapes_a_pod_ip(cluster, namespace, prometheus_factory):
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "exporter", "labels": {"serving.kvpilot.dev/inferenceservice": "svc-a"},
                        "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "18081", "prometheus.io/path": "/metrics"}},
           "spec": {"containers": [{"name": "c", "image": "exporter:1"}]}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
    ip = wait_until(lambda: kget(cluster, "pod", "exporter", "-n", namespace)["status"].get("podIP"), what="pod IP")
    require_loopback(ip)
    handler = type("H", (_Metrics,), {"body": b"kvpilot_test_value 42\n"})
    server = ThreadingHTTPServer((ip, 18081), handler)  # a local process standing in for the pod's container
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prom = prometheus_factory()
        prom.add_kubernetes_pods(cluster.server, TOKEN, str(cluster.state_dir / "certs" / "apiserver.crt"))
        start_prometheus(prom)
        result = prom.wait_for(f'kvpilot_test_value{{namespace="{namespace}"}}', timeout=45)
        (sample,) = result
        assert sample["value"][1] == "42"
        assert sample["metric"]["pod"] == "exporter" and sample["metric"]["inferenceservice"] == "svc-a"
        assert sample["metric"]["instance"] == f"{ip}:18081"
    finally:
        server.shutdown()
        server.server_close()


def test_loopback_guard_refuses_other_addresses():
    for ok in ("127.0.0.1", "127.1.0.7", "http://127.0.0.1:9090/x", "localhost", "[::1]"):
        assert require_loopback(ok)
    for bad in ("10.96.0.1", "http://10.96.0.10:80", "192.168.1.1", "8.8.8.8", "https://172.17.0.2:6443"):
        with pytest.raises(NotLoopbackError):
            require_loopback(bad)


def test_teardown_leaves_no_process_or_port(tmp_path):
    c = Cluster(name="teardown", state_dir=tmp_path / "c").up(nodes=1, gpus_per_node=1, timeout=90)
    pids, ports = dict(c.pids), dict(c.ports)
    assert all(port_open("127.0.0.1", ports[k]) for k in ("etcd", "apiserver"))
    c.down()
    for name, pid in pids.items():
        try:
            os.kill(pid, 0)
            alive = not open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        except ProcessLookupError:
            alive = False
        assert not alive, f"{name} (pid {pid}) still running"
    for name, port in ports.items():
        assert not port_open("127.0.0.1", port), f"{name} still listens on {port}"
        with socket.socket() as s:  # and nobody holds it (TIME_WAIT leftovers are fine, hence SO_REUSEADDR)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
