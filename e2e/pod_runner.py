"""Test infrastructure (not product): runs the engine container of each kvpilot engine pod that kwok
reports Running, as a local process bound to the pod's loopback IP; with a kubeconfig, also the
operator pods that the Helm chart creates (`python -m kvpilot.operator` with the pod's args, env and
ServiceAccount: a token requested for it).

It runs the pod's init containers first (model downloads: `kvpilot fetch-model`), with each emptyDir
volume a host directory and paths under a volume mount moved there, expands `$(VAR)` references
from the container's env (downward-API POD_IP included), runs the command with 1 torch thread under `nice`, sets serving.kvpilot.dev/engine-ready=true once the
engine's /ready answers (kwok's Stage then marks the pod Ready), clears it when the engine stops
answering, and stops the process (SIGTERM: the engine drains) when the pod goes away.

With `--runtime podman` every container runs from the image its pod names instead (built by `make
images`), as a kubelet would: `podman run` on the host network (each server bound to its pod IP),
the pod's user, a read-only root filesystem with its emptyDirs mounted where the pod mounts them, the
termination log at /dev/termination-log, and the operator and gateway with a kubeconfig (their
ServiceAccount's token, the apiserver's CA inlined) mounted. podman stays attached, so the process
the runner watches is the container: its exit code is the container's, SIGTERM reaches the engine.

    python -m e2e.pod_runner --kubeconfig PATH [--log-dir DIR] [--runtime process|podman]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from e2e.cluster import ENGINE_LABEL, ENGINE_READY_ANNOTATION, TOKEN, _insecure
from e2e.net import free_port, require_loopback
from kvpilot.operator.status import now_rfc3339

ENGINE_KIND_LABEL = "serving.kvpilot.dev/engine"
LOADER_LABEL = "serving.kvpilot.dev/model-cache-entry"  # a model cache entry's loader (a Job's pod): run once, to completion
RUNTIMES = ("process", "podman")
CONTAINER_KUBECONFIG = "/var/run/kvpilot/kubeconfig"
RUNNER_LABEL = "dev.kvpilot.pod-runner=1"  # every container the runner starts: `down` removes any left behind
GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"  # the same on every pod of one LeaderWorkerSet group
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known variables are replaced, unknown ones stay as written."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), value)


def container_env(container: dict, pod: dict) -> dict[str, str]:
    # Every pod here is bound to a loopback IP: NIXL's UCX (prefill/decode pods) is kept on the loopback device too
    # (by default its TCP transport would offer, and peers connect to, every interface of the machine).
    env = {"UCX_NET_DEVICES": "lo"}
    for e in container.get("env", []) or []:
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = pod["status"]["podIP"]
        elif (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = pod["metadata"]["name"]
        elif (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[e["name"]] = pod["metadata"]["namespace"]
    return env


# The chart's own pods (operator, gateway), by label selector: run as local processes with their ServiceAccount.
CHART_SELECTOR = "app.kubernetes.io/name in (kvpilot-operator,kvpilot-gateway)"
# ...and its hook Jobs' pods (the CRD upgrade), run to completion like loaders, as their ServiceAccount.
HOOK_LABEL = ("app.kubernetes.io/name", "kvpilot-crd-upgrade")
HOOK_SELECTOR = "=".join(HOOK_LABEL)


def operator_argv(pod: dict) -> tuple[list[str], dict[str, str]]:
    """A chart pod's container as a local process: the operator image's entry points are
    `python -m kvpilot.operator` and `kvpilot-gateway` (= `python -m kvpilot.operator.gateway`, told
    to listen on the pod's own IP, since every pod shares this host)."""
    container = pod["spec"]["containers"][0]
    env = {k: v for k, v in container_env(container, pod).items() if k not in CONTAINER_PATH_ENV}
    args = [expand(a, env) for a in container.get("args") or []]
    if container["name"] == "gateway":
        return [sys.executable, "-m", "kvpilot.operator.gateway", "--host", require_loopback(pod["status"]["podIP"]), *args], env
    return [sys.executable, "-m", "kvpilot.operator", *args], env


# Paths inside the container (its emptyDir caches): the host process keeps its own, where the compiled
# kernels already are.
CONTAINER_PATH_ENV = ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR")


def container_argv(container: dict, pod: dict, volumes: dict[str, Path] | None = None) -> tuple[list[str], dict[str, str]]:
    """A container's command line as a local process: $(VAR)s expanded, paths under its volume
    mounts moved to the volumes' host directories (`volumes`: volume name -> directory)."""
    env = {k: v for k, v in container_env(container, pod).items() if k not in CONTAINER_PATH_ENV}
    argv = [expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])]
    mounts = sorted(((m["mountPath"], volumes[m["name"]]) for m in container.get("volumeMounts") or [] if volumes and m["name"] in volumes),
                    key=lambda m: -len(m[0]))
    for i, arg in enumerate(argv):
        mount = next(((path, host) for path, host in mounts if arg == path or arg.startswith(path + "/")), None)
        if mount:
            argv[i] = str(mount[1]) + arg[len(mount[0]):]
    if argv and argv[0] == "kvpilot":  # the venv's console script stands in for the image's
        argv[0] = str(Path(sys.executable).parent / "kvpilot")
    elif argv and argv[0] in ("python", "python3"):  # ...and its interpreter for the image's
        argv[0] = sys.executable
    return argv, env


def engine_argv(pod: dict, volumes: dict[str, Path] | None = None) -> tuple[list[str], dict[str, str]]:
    argv, env = container_argv(next(c for c in pod["spec"]["containers"] if c["name"] == "engine"), pod, volumes)
    if "--num-threads" not in argv:
        argv += ["--num-threads", "1"]
    return argv, env


def podman() -> list[str]:
    """podman with the containers.conf that `make images` writes for this kind of machine."""
    from kvpilot.kernels.cache import cache_root

    conf = cache_root() / "podman" / "containers.conf"
    if not conf.is_file():
        raise RuntimeError(f"{conf} missing: run `make images` first")
    os.environ["CONTAINERS_CONF"] = str(conf)
    return ["podman"]


def container_name(uid: str, container: str) -> str:
    return f"kvpilot-pod-{uid[:13]}-{container}"


def pod_user(pod: dict) -> tuple[int, int]:
    """The pod's runAsUser and runAsGroup (the images' 65532 when unset)."""
    security = pod["spec"].get("securityContext") or {}
    return security.get("runAsUser", 65532), security.get("runAsGroup", security.get("runAsUser", 65532))


def podman_run(uid: str, pod: dict, container: dict, volumes: dict[str, Path], *, env: dict[str, str] | None = None,
               args_before: list[str] | None = None, args_after: list[str] | None = None,
               files: dict[Path, str] | None = None) -> tuple[str, list[str]]:
    """(name, argv) of `podman run` for one of the pod's containers, attached (the caller's process is
    the container's life), any leftover of the same name removed first: host network, the pod's user,
    its emptyDirs (a Memory one at /dev/shm becomes --shm-size), `files` (host file -> path in the
    container) mounted, the container's env plus `env`, its args ($(VAR)s expanded) between
    `args_before` and `args_after`."""
    name = container_name(uid, container["name"])
    stop_container(name)
    spec_env = container_env(container, pod)
    args = [*(args_before or []), *(expand(a, spec_env) for a in container.get("args") or []), *(args_after or [])]
    user, group = pod_user(pod)
    argv = [*podman(), "run", "--rm", "--name", name, "--label", RUNNER_LABEL, "--network", "host", "--pull", "never", "--init",
            "--user", f"{user}:{group}"]
    csc = container.get("securityContext") or {}
    if csc.get("readOnlyRootFilesystem"):
        argv.append("--read-only")
    if csc.get("allowPrivilegeEscalation") is False:
        argv += ["--security-opt", "no-new-privileges"]
    for cap in (csc.get("capabilities") or {}).get("drop") or []:
        argv += ["--cap-drop", cap]
    spec_volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    for m in container.get("volumeMounts") or []:
        v = spec_volumes.get(m["name"], {})
        if (v.get("emptyDir") or {}).get("medium") == "Memory" and m["mountPath"] == "/dev/shm":
            argv += ["--shm-size", v["emptyDir"].get("sizeLimit", "64Mi").replace("Gi", "g").replace("Mi", "m")]
        elif m["name"] in volumes:
            argv += ["-v", f"{volumes[m['name']]}:{m['mountPath']}{':ro' if m.get('readOnly') else ''}"]
    for host, path in (files or {}).items():
        argv += ["-v", f"{host}:{path}"]
    for k, v in {**spec_env, **(env or {})}.items():
        argv += ["-e", f"{k}={v}"]
    if container.get("command"):
        argv += ["--entrypoint", json.dumps(container["command"])]
    return name, [*argv, container["image"], *args]


def stop_container(name: str) -> None:
    """What is left of a container whose podman process is gone (killed): removed, whatever its state."""
    subprocess.run([*podman(), "rm", "-f", "-t", "5", name], capture_output=True, timeout=60)


@dataclass
class PodProcess:
    pod: str
    namespace: str
    ip: str
    port: int
    proc: subprocess.Popen
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    container: str | None = None  # podman: the container's name


class PodRunner:
    """kubeconfig (the admin one): also run operator pods, each with its own ServiceAccount's kubeconfig."""

    def __init__(self, server: str, log_dir: Path, token: str = TOKEN, poll: float = 0.5, kubeconfig: dict | None = None,
                 runtime: str = "process"):
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
        self.server, self.token, self.poll, self.kubeconfig, self.runtime = server, token, poll, kubeconfig, runtime
        self.operators: dict[str, PodProcess] = {}  # pod uid -> operator or gateway process
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.engines: dict[str, PodProcess] = {}  # pod uid -> engine
        self.loaders_run: set[str] = set()  # loader pod uids run to completion
        self.init_backoff: dict[str, float] = {}  # pod uid -> when its failed init containers may run again
        self.restart_backoff: dict[str, tuple[float, float]] = {}  # pod uid -> (when its engine may start again, the delay)
        self.group_ports: dict[str, int] = {}  # LeaderWorkerSet group key -> its rendezvous port (all pods share this host)
        self._stop = threading.Event()
        self._http = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {token}"}, timeout=10)
        self.events: list[tuple[float, str, str]] = []  # (time, pod, what) for reports

    def _pods(self) -> list[dict]:
        r = self._http.get(f"{self.server}/api/v1/pods", params={"labelSelector": f"{ENGINE_LABEL},{ENGINE_KIND_LABEL}=kvpilot"})
        r.raise_for_status()
        return r.json()["items"]

    def _annotate(self, pod: dict, ready: bool) -> None:
        patch = {"metadata": {"annotations": {ENGINE_READY_ANNOTATION: "true" if ready else None}}}
        m = pod["metadata"]
        self._http.patch(f"{self.server}/api/v1/namespaces/{m['namespace']}/pods/{m['name']}", content=json.dumps(patch),
                         headers={"Content-Type": "application/merge-patch+json"})

    def _step_operators(self) -> None:
        r = self._http.get(f"{self.server}/api/v1/pods", params={"labelSelector": CHART_SELECTOR})
        r.raise_for_status()
        pods = {p["metadata"]["uid"]: p for p in r.json()["items"]}
        for uid in list(self.operators):
            pod = pods.get(uid)
            if pod is None or pod["metadata"].get("deletionTimestamp") or self.operators[uid].proc.poll() is not None:
                self._stop_process(self.operators.pop(uid))  # gone, or exited (then started again below)
        for uid, pod in pods.items():
            if uid not in self.operators and not pod["metadata"].get("deletionTimestamp") and pod["status"].get("phase") == "Running" \
                    and pod["status"].get("podIP"):
                self._start_operator(uid, pod)

    def _service_account_kubeconfig(self, pod: dict) -> Path:
        """A kubeconfig with a token of the pod's ServiceAccount (as the kubelet mounts one): the pod acts as itself."""
        m = pod["metadata"]
        sa = pod["spec"].get("serviceAccountName", "default")
        r = self._http.post(f"{self.server}/api/v1/namespaces/{m['namespace']}/serviceaccounts/{sa}/token",
                            json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 86400}})
        r.raise_for_status()
        kubeconfig = self.log_dir / f"{m['namespace']}_{m['name']}.kubeconfig"
        user = {"name": "admin", "user": {"token": r.json()["status"]["token"]}}
        kubeconfig.write_text(json.dumps({**self.kubeconfig, "users": [user]} if self.runtime == "process" else self._portable_kubeconfig(user)))
        return kubeconfig

    def _start_operator(self, uid: str, pod: dict) -> None:
        m = pod["metadata"]
        kubeconfig = self._service_account_kubeconfig(pod)
        log = open(self.log_dir / f"{m['namespace']}_{m['name']}.log", "ab")
        name = None
        if self.runtime == "process":
            kubeconfig.chmod(0o600)
            argv, env = operator_argv(pod)
            env = {**os.environ, **env, "KUBECONFIG": str(kubeconfig)}
        else:
            kubeconfig.chmod(0o644)  # read by the container's user
            container = pod["spec"]["containers"][0]
            # every pod shares the host's network: the gateway listens on the pod's own IP
            host = ["--host", require_loopback(pod["status"]["podIP"])] if container["name"] == "gateway" else []
            name, argv = podman_run(uid, pod, container, self._volumes(uid, pod), env={"KUBECONFIG": CONTAINER_KUBECONFIG},
                                    args_before=host, files={kubeconfig: f"{CONTAINER_KUBECONFIG}:ro"})
            env = None
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.operators[uid] = PodProcess(m["name"], m["namespace"], require_loopback(pod["status"]["podIP"]), 8080, proc, container=name)
        self.events.append((time.time(), m["name"], f"{pod['spec']['containers'][0]['name']} started"))

    def _portable_kubeconfig(self, user: dict) -> dict:
        """The admin kubeconfig with the CA inlined (one file to mount into a container) and `user`."""
        import base64

        clusters = []
        for c in self.kubeconfig["clusters"]:
            cluster = dict(c["cluster"])
            if "certificate-authority" in cluster:
                cluster["certificate-authority-data"] = base64.b64encode(Path(cluster.pop("certificate-authority")).read_bytes()).decode()
            clusters.append({**c, "cluster": cluster})
        return {**self.kubeconfig, "clusters": clusters, "users": [user]}

    def step(self) -> None:
        if self.kubeconfig is not None:
            self._step_operators()
        self._step_loaders()
        pods = {p["metadata"]["uid"]: p for p in self._pods()}
        for uid in list(self.engines):
            pod = pods.get(uid)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                self._stop_engine(uid)
        for uid, pod in pods.items():
            if pod["metadata"].get("deletionTimestamp") or pod["status"].get("phase") != "Running" or not pod["status"].get("podIP"):
                continue
            eng = self.engines.get(uid)
            if eng is None:
                self._start_engine(uid, pod)
                continue
            if eng.proc.poll() is not None:  # the engine died: not ready, restarted after a back-off
                self.events.append((time.time(), pod["metadata"]["name"], f"exited {eng.proc.returncode}"))
                if eng.ready:
                    self._annotate(pod, False)
                del self.engines[uid]
                self._report_crash(uid, pod, eng.proc.returncode)
                continue
            ok = self._ready(eng)
            annotated = (pod["metadata"].get("annotations") or {}).get(ENGINE_READY_ANNOTATION) == "true"
            if ok != annotated:
                self._annotate(pod, ok)
                self.events.append((time.time(), pod["metadata"]["name"], "ready" if ok else "not ready"))
            eng.ready = ok

    def _step_loaders(self) -> None:
        """Each Running loader pod's container to completion, then the pod's phase as a kubelet
        reports it (Succeeded or Failed, the container's exit code and termination message): what the
        Job controller counts. Blocking, like init containers: loopback-sized downloads."""
        pods = []
        for selector in (LOADER_LABEL, *([HOOK_SELECTOR] if self.kubeconfig is not None else [])):
            r = self._http.get(f"{self.server}/api/v1/pods", params={"labelSelector": selector})
            r.raise_for_status()
            pods += r.json()["items"]
        for pod in pods:
            uid, m = pod["metadata"]["uid"], pod["metadata"]
            if uid in self.loaders_run or m.get("deletionTimestamp") or pod["status"].get("phase") != "Running":
                continue
            self.loaders_run.add(uid)
            container = pod["spec"]["containers"][0]
            volumes = self._volumes(uid, pod)
            termination_log = self._termination_log(uid)
            termination_log.write_text("")
            if self.runtime == "process":
                argv, env = container_argv(container, pod, volumes)
                env = {**os.environ, **env, "KVPILOT_TERMINATION_LOG": str(termination_log)}
                if (m.get("labels") or {}).get(HOOK_LABEL[0]) == HOOK_LABEL[1]:  # a chart hook: it acts as its ServiceAccount
                    env["KUBECONFIG"] = str(self._service_account_kubeconfig(pod))
            else:
                termination_log.chmod(0o666)
                argv, env = podman_run(uid, pod, container, volumes, files={termination_log: "/dev/termination-log"})[1], None
            started = now_rfc3339()
            with open(self.log_dir / f"{m['namespace']}_{m['name']}.log", "ab") as log:
                code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=600).returncode
            self.events.append((time.time(), m["name"], f"loader exited {code}"))
            terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "startedAt": started, "finishedAt": now_rfc3339(),
                          "message": termination_log.read_text(errors="replace")[-4096:]}
            status = {"phase": "Succeeded" if code == 0 else "Failed",
                      "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": now_rfc3339()}],
                      "containerStatuses": [{"name": container["name"], "image": container.get("image", ""), "imageID": "", "ready": False,
                                             "restartCount": 0, "started": False, "state": {"terminated": terminated}}]}
            r = self._http.patch(f"{self.server}/api/v1/namespaces/{m['namespace']}/pods/{m['name']}/status", content=json.dumps({"status": status}),
                                 headers={"Content-Type": "application/strategic-merge-patch+json"})
            if r.status_code != 200:
                raise RuntimeError(f"loader pod {m['namespace']}/{m['name']}: status not written: {r.status_code} {r.text[:500]}")

    def _ready(self, eng: PodProcess) -> bool:
        try:
            return httpx.get(f"http://{eng.ip}:{eng.port}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _with_secret_env(self, pod: dict) -> dict:
        """The pod with each env entry read from a Secret (valueFrom.secretKeyRef) given its value, as the
        kubelet does (the engines of a disaggregated service share a KV transfer key that way)."""
        pod = json.loads(json.dumps(pod))
        namespace = pod["metadata"]["namespace"]
        for container in pod["spec"]["containers"]:
            for e in container.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    r = self._http.get(f"{self.server}/api/v1/namespaces/{namespace}/secrets/{ref['name']}")
                    r.raise_for_status()
                    e.pop("valueFrom")
                    e["value"] = base64.b64decode(r.json()["data"][ref["key"]]).decode()
        return pod

    def _in_group(self, pod: dict) -> dict | None:
        """A LeaderWorkerSet group's pod as this host runs it: the leader's address its webhook wrote
        (LWS_LEADER_ADDRESS, <leader pod>.<subdomain>.<namespace>: the cluster has no DNS) becomes the leader pod's IP,
        and each group meets on a port of its own (--group-port: every pod shares this host's ports, where each
        would have its own). None while the leader has no IP yet."""
        key = ((pod["metadata"].get("labels") or {}).get(GROUP_KEY_LABEL))
        if key is None:
            return pod
        pod = json.loads(json.dumps(pod))
        engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
        for e in engine.get("env") or []:
            if e["name"] == "LWS_LEADER_ADDRESS" and "value" in e:
                r = self._http.get(f"{self.server}/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{e['value'].split('.')[0]}")
                ip = r.json().get("status", {}).get("podIP") if r.status_code == 200 else None
                if not ip:
                    return None
                e["value"] = require_loopback(ip)
        if key not in self.group_ports:
            self.group_ports[key] = free_port()
        engine["args"] = [*(engine.get("args") or []), "--group-port", str(self.group_ports[key])]
        return pod

    def _start_engine(self, uid: str, pod: dict) -> None:
        pod = self._in_group(self._with_secret_env(pod))
        if pod is None:
            return
        ip = require_loopback(pod["status"]["podIP"])
        name = pod["metadata"]["name"]
        log_path = self.log_dir / f"{pod['metadata']['namespace']}_{name}.log"
        if time.monotonic() < self.restart_backoff.get(uid, (0, 0))[0]:
            return
        volumes = self._volumes(uid, pod)
        if not self._run_init_containers(uid, pod, volumes, log_path):
            return
        argv, env = engine_argv(pod, volumes)
        port = int(argv[argv.index("--port") + 1]) if "--port" in argv else 8000
        log = open(log_path, "ab")
        termination_log = self._termination_log(uid)
        termination_log.write_text("")
        container = None
        if self.runtime == "process":
            proc_env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "KVPILOT_TERMINATION_LOG": str(termination_log)}
            argv = ["nice", "-n", "5", *argv]
        else:
            termination_log.chmod(0o666)  # written by the container's user
            spec = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
            container, argv = podman_run(uid, pod, spec, volumes, env={"OMP_NUM_THREADS": "1"},
                                         args_after=[] if "--num-threads" in (spec.get("args") or []) else ["--num-threads", "1"],
                                         files={termination_log: spec.get("terminationMessagePath", "/dev/termination-log")})
            proc_env = None
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=proc_env, start_new_session=True)
        self.engines[uid] = PodProcess(name, pod["metadata"]["namespace"], ip, port, proc, container=container)
        self.events.append((time.time(), name, f"started on {ip}:{port}"))

    def _termination_log(self, uid: str) -> Path:
        """The engine container's terminationMessagePath, as the kubelet provides it (an empty file)."""
        path = self.log_dir / "volumes" / uid / "termination-log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _report_crash(self, uid: str, pod: dict, exit_code: int) -> None:
        """What the kubelet reports for a container that exited: its exit code and termination message
        as the last state, CrashLoopBackOff while it waits to be restarted (10 s, doubling to 5 min)."""
        _, delay = self.restart_backoff.get(uid, (0, 5))
        delay = min(2 * delay, 300)
        self.restart_backoff[uid] = (time.monotonic() + delay, delay)
        restarts = sum(1 for _, p, what in self.events if p == pod["metadata"]["name"] and what.startswith("exited"))
        message = self._termination_log(uid).read_text(errors="replace")[-4096:]
        status = {"containerStatuses": [{
            "name": "engine", "image": pod["spec"]["containers"][0].get("image", ""), "ready": False, "started": False, "restartCount": restarts,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off {delay}s restarting failed container=engine"}},
            "lastState": {"terminated": {"exitCode": exit_code, "reason": "Error", "message": message}}}]}
        m = pod["metadata"]
        self._http.patch(f"{self.server}/api/v1/namespaces/{m['namespace']}/pods/{m['name']}/status", content=json.dumps({"status": status}),
                         headers={"Content-Type": "application/strategic-merge-patch+json"})

    def _claim_directory(self, namespace: str, claim: str) -> Path:
        """The host directory of the PersistentVolume bound to a claim (the local control plane's PVs
        are hostPath or local volumes: this host's directories)."""
        r = self._http.get(f"{self.server}/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
        r.raise_for_status()
        volume = r.json()["spec"].get("volumeName")
        if not volume:
            raise RuntimeError(f"claim {namespace}/{claim} is not bound")
        r = self._http.get(f"{self.server}/api/v1/persistentvolumes/{volume}")
        r.raise_for_status()
        spec = r.json()["spec"]
        return Path((spec.get("hostPath") or spec.get("local"))["path"])

    def _volumes(self, uid: str, pod: dict) -> dict[str, Path]:
        """The pod's emptyDir volumes as host directories (kept for the pod's life, like the kubelet's),
        its claims as their volumes' directories."""
        volumes = {}
        for v in pod["spec"].get("volumes") or []:
            if "persistentVolumeClaim" in v:
                volumes[v["name"]] = self._claim_directory(pod["metadata"]["namespace"], v["persistentVolumeClaim"]["claimName"])
            elif "configMap" in v:  # its keys as files, as the kubelet projects them
                r = self._http.get(f"{self.server}/api/v1/namespaces/{pod['metadata']['namespace']}/configmaps/{v['configMap']['name']}")
                r.raise_for_status()
                volumes[v["name"]] = self.log_dir / "volumes" / uid / v["name"]
                volumes[v["name"]].mkdir(parents=True, exist_ok=True)
                for key, text in (r.json().get("data") or {}).items():
                    (volumes[v["name"]] / key).write_text(text)
            elif "emptyDir" in v:
                volumes[v["name"]] = self.log_dir / "volumes" / uid / v["name"]
                volumes[v["name"]].mkdir(parents=True, exist_ok=True)
                if self.runtime == "podman":  # fsGroup: the pod's user owns its emptyDirs
                    user, group = pod_user(pod)
                    os.chown(volumes[v["name"]], user, (pod["spec"].get("securityContext") or {}).get("fsGroup", group))
        return volumes

    def _run_init_containers(self, uid: str, pod: dict, volumes: dict[str, Path], log_path: Path) -> bool:
        """Each init container in order, to completion (as the kubelet does before the main container);
        one that fails is tried again after a back-off. Blocking: fine for loopback-sized downloads."""
        if time.monotonic() < self.init_backoff.get(uid, 0):
            return False
        for c in pod["spec"].get("initContainers") or []:
            if self.runtime == "process":
                argv, env = container_argv(c, pod, volumes)
                env = {**os.environ, **env}
            else:
                argv, env = podman_run(uid, pod, c, volumes)[1], None
            with open(log_path, "ab") as log:
                r = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=600)
            self.events.append((time.time(), pod["metadata"]["name"], f"init container {c['name']} exited {r.returncode}"))
            if r.returncode != 0:
                self.init_backoff[uid] = time.monotonic() + 10
                return False
        return True

    def _stop_engine(self, uid: str) -> None:
        self._stop_process(self.engines.pop(uid))

    def _stop_process(self, eng: PodProcess) -> None:
        self._signal(eng)
        self._reap(eng)

    @staticmethod
    def _signal(eng: PodProcess) -> None:
        if eng.proc.poll() is None:
            os.killpg(eng.proc.pid, signal.SIGTERM)  # the engine drains, then exits (podman passes it on)

    def _reap(self, eng: PodProcess) -> None:
        try:
            eng.proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(eng.proc.pid, signal.SIGKILL)
            eng.proc.wait()
        if eng.container:
            stop_container(eng.container)
        self.events.append((time.time(), eng.pod, "stopped"))

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except httpx.HTTPError:
                pass  # the apiserver blinked: try again next round
            self._stop.wait(self.poll)

    def start(self) -> PodRunner:
        self._thread = threading.Thread(target=self.run, name="pod-runner", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if getattr(self, "_thread", None):
            self._thread.join(10)
        every = [*self.engines.values(), *self.operators.values()]
        self.engines, self.operators = {}, {}
        for p in every:  # all at once: each drains in parallel
            self._signal(p)
        for p in every:
            self._reap(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m e2e.pod_runner")
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--log-dir", default="pod-runner-logs")
    ap.add_argument("--runtime", choices=RUNTIMES, default="process",
                    help="process: each container as a local process of this checkout; podman: from its pod's image (`make images`)")
    args = ap.parse_args(argv)
    cfg = json.loads(Path(args.kubeconfig).read_text())
    runner = PodRunner(cfg["clusters"][0]["cluster"]["server"], Path(args.log_dir), cfg["users"][0]["user"]["token"], kubeconfig=cfg,
                       runtime=args.runtime)
    signal.signal(signal.SIGTERM, lambda *_: runner._stop.set())
    try:
        runner.run()
    except KeyboardInterrupt:
        pass
    finally:
        runner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
