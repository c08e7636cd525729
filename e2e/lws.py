"""LeaderWorkerSet (kubernetes-sigs/lws, built by e2e/tools/build.sh with the control plane) on the local
control plane: its CRD, its controller as a local process, and its admission webhooks, which the
apiserver calls on 127.0.0.1 over TLS (a certificate made here: no cert-manager, no Service, no DNS).

    start_lws(cluster)   # idempotent; stopped with cluster.down()

The pod webhook writes LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX into every container of a
group's pods when they are created; the pod runner resolves the leader's name to its pod IP (the cluster
has no DNS).
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path

from e2e.cluster import Cluster, ToolMissing, _http_ok, versions
from e2e.net import free_port
from kvpilot.kernels.cache import cache_root

WEBHOOKS = "kvpilot-e2e-lws"  # the webhook configurations' name


def lws_paths() -> tuple[Path, list[Path]]:
    """The controller binary and its CRDs (copied beside it at build time: LeaderWorkerSet's, and DisaggregatedSet's, whose
    controller it also runs); ToolMissing says how to build them."""
    d = cache_root() / "bin" / f"lws-{versions()['LWS_VERSION']}"
    binary, crds = d / "lws-controller", [d / "leaderworkersets.yaml", d / "disaggregatedsets.yaml"]
    if not all(p.exists() for p in (binary, *crds)):
        raise ToolMissing(f"LeaderWorkerSet not built ({d}): run `make tools` (bash e2e/tools/build.sh)")
    return binary, crds


def _certificate(directory: Path) -> bytes:
    """A CA and a serving certificate for 127.0.0.1 signed by it (controller-runtime reads tls.crt and tls.key from its
    certDir); the CA's PEM, the webhooks' caBundle."""
    directory.mkdir(parents=True, exist_ok=True)
    run = lambda *args: subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=kvpilot-e2e-lws-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=127.0.0.1")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "tls.crt", "-days", "2",
        "-extfile", "san.ext")
    return (directory / "ca.crt").read_bytes()


def _webhooks(port: int, ca: bytes) -> list[dict]:
    """LWS's own four webhooks (config/webhook/ of its module), called by URL. The pod ones on CREATE only: the mutation
    that matters (the group's variables) is at creation, and the pod runner's status and annotation writes need no
    round trip to the controller."""
    bundle = base64.b64encode(ca).decode()

    def hook(name: str, path: str, group: str, resource: str, operations: list[str], pods: bool) -> dict:
        out = {"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail", "timeoutSeconds": 10,
               "clientConfig": {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle},
               "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": operations, "resources": [resource]}]}
        if pods:
            out["objectSelector"] = {"matchExpressions": [{"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}
        return out

    lws = ("leaderworkerset.x-k8s.io", "leaderworkersets", ["CREATE", "UPDATE"], False)
    pod = ("", "pods", ["CREATE"], True)
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration", "metadata": {"name": WEBHOOKS},
         "webhooks": [hook("mleaderworkerset.kb.io", "/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset", *lws),
                      hook("mpod.kb.io", "/mutate--v1-pod", *pod)]},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration", "metadata": {"name": WEBHOOKS},
         "webhooks": [hook("vleaderworkerset.kb.io", "/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset", *lws),
                      hook("vpod.kb.io", "/validate--v1-pod", *pod)]},
    ]


def start_lws(cluster: Cluster, timeout: float = 60) -> None:
    """The CRDs (server-side: their 1.3 MB is past the client-side annotation's limit), the controller (no leader election, its
    metrics off, every listener on 127.0.0.1), then the webhooks once it answers."""
    if "lws" in cluster.pids:
        return
    binary, crds = lws_paths()
    for crd in crds:
        cluster.kubectl("apply", "--server-side", "-f", str(crd), timeout=120)
    state = cluster.state_dir / "lws"
    ca = _certificate(state / "certs")
    cluster.ports["lws_webhook"], cluster.ports["lws_health"] = free_port(), free_port()
    config = state / "config.json"  # (YAML is JSON's superset: the controller reads it)
    config.write_text(json.dumps({
        "apiVersion": "config.lws.x-k8s.io/v1alpha1", "kind": "Configuration",
        "leaderElection": {"leaderElect": False}, "internalCertManagement": {"enable": False},
        "webhook": {"port": cluster.ports["lws_webhook"], "host": "127.0.0.1", "certDir": str(state / "certs")},
        "metrics": {"bindAddress": "0"}, "health": {"healthProbeBindAddress": f"127.0.0.1:{cluster.ports['lws_health']}"}}))
    cluster._start("lws", [binary, f"--config={config}", f"--kubeconfig={cluster.kubeconfig}"])
    deadline = time.monotonic() + timeout
    cluster._wait("LeaderWorkerSet controller", lambda: _http_ok(f"http://127.0.0.1:{cluster.ports['lws_health']}/readyz"), deadline)
    for obj in _webhooks(cluster.ports["lws_webhook"], ca):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    cluster._save()

