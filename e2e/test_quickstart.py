"""The README's local quick start, step by step, as a user runs it: `python -m e2e.cluster up` (what
`make cluster-up` runs) on its own cluster, the chart installed with the helm line it prints (its
operator and gateway pods run by the pod runner), the CPU example applied with kubectl, Ready, its
cold start by phase in `kubectl describe`, a completion through the pod IP and through the gateway, the KV column filled from Prometheus, then `down` leaving no process behind.

Twice: with the pods as local processes, and with every pod run from its image by podman (`make
images` built them; `.ci/run` builds them before the tests): the operator, the gateway and the
engine are containers of kvpilot/operator and kvpilot/engine, the engine loads the image's prebuilt
kernels, and deleting the InferenceService stops its container."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from e2e.cluster import kubectl_path
from e2e.net import require_loopback
from e2e.pod_runner import podman
from e2e.waiting import wait_until

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]
VERSION = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def containers() -> dict[str, str]:
    """Running podman containers of the pod runner: name -> image."""
    out = subprocess.run([*podman(), "ps", "--filter", "name=^kvpilot-pod-", "--format", "{{.Names}} {{.Image}}"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return dict(line.split() for line in out.splitlines())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("runtime", ["process", "podman"])
def test_readme_local_quick_start(tmp_path, runtime):
    env = {**os.environ, "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))}
    name = f"quickstart-{runtime}"
    if runtime == "podman":
        for image in ("engine", "operator"):  # built by `make images` (a phase of `make test` before pytest)
            assert subprocess.run([*podman(), "image", "exists", f"kvpilot/{image}:{VERSION}"], timeout=60).returncode == 0, \
                f"kvpilot/{image}:{VERSION} not built: run `make images`"
    up = subprocess.run([sys.executable, "-m", "e2e.cluster", "up", "--name", name, "--pod-runtime", runtime], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=180)
    pod_ip = prometheus = "none yet"
    try:
        assert up.returncode == 0, up.stderr
        kubeconfig = re.search(r"^export KUBECONFIG=(\S+)$", up.stdout, re.M).group(1)
        helm_line = re.search(r"^install the operator: (.+)$", up.stdout, re.M).group(1)
        prometheus = re.search(r"prometheusUrl=(\S+)", helm_line).group(1)
        env["KUBECONFIG"] = kubeconfig

        def kubectl(*args: str) -> str:
            return subprocess.run([kubectl_path(), *args], env=env, capture_output=True, text=True, check=True, timeout=60).stdout

        subprocess.run(shlex.split(helm_line), cwd=ROOT, env=env, check=True, capture_output=True, timeout=120)
        pods = json.loads(kubectl("get", "pods", "-n", "kvpilot-system", "-l", "app.kubernetes.io/name=kvpilot-operator", "-o", "json"))["items"]
        assert len(pods) == 2 and all(p["status"]["phase"] == "Running" for p in pods)
        leader = wait_until(lambda: kubectl("get", "lease", "kvpilot-operator", "-n", "kvpilot-system",
                                            "-o", "jsonpath={.spec.holderIdentity}"), timeout=30, what="an operator replica leads")
        assert leader.split("_")[0] in {p["metadata"]["name"] for p in pods}
        kubectl("apply", "-f", str(ROOT / "crds" / "examples" / "smollm2-cpu.yaml"))
        wait_until(lambda: json.loads(kubectl("get", "kvis", "smollm2", "-o", "json")).get("status", {}).get("readyReplicas") == 1,
                   timeout=120, what="smollm2 Ready (model load)")
        # the README's describe line: the pod's start, phase by phase, measured by the operator when it turned Ready
        described = wait_until(lambda: (lambda d: d if "Last Cold Start" in d else None)(kubectl("describe", "kvis", "smollm2")), timeout=30,
                               what="the cold start in the status")
        phases = kubectl("get", "kvis", "smollm2", "-o", "jsonpath={.status.lastColdStart.phases[*].name}").split()
        assert phases == ["scheduling", "model", "import", "load", "warmup", "listen", "ready"], described
        pod_ip = kubectl("get", "pods", "-l", "serving.kvpilot.dev/inferenceservice=smollm2", "-o", "jsonpath={.items[0].status.podIP}")
        r = httpx.post(f"http://{require_loopback(pod_ip)}:8000/v1/completions", timeout=60,
                       json={"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"], r.text
        if runtime == "podman":
            uid = kubectl("get", "pods", "-l", "serving.kvpilot.dev/inferenceservice=smollm2", "-o", "jsonpath={.items[0].metadata.uid}")
            running = containers()
            engine = next(n for n in running if n.startswith(f"kvpilot-pod-{uid[:13]}-"))
            assert running[engine].endswith(f"kvpilot/engine:{VERSION}"), running
            assert sum(image.endswith(f"kvpilot/operator:{VERSION}") for image in running.values()) == 4, running  # 2 operators + 2 gateways
            log = subprocess.run([*podman(), "logs", engine], capture_output=True, text=True, timeout=60)
            assert "CPU kernels: x86-64-v" in log.stdout + log.stderr and "compiling" not in log.stdout + log.stderr, log.stderr[-2000:]
        gateway_ip = kubectl("get", "pods", "-n", "kvpilot-system", "-l", "app.kubernetes.io/name=kvpilot-gateway", "-o", "jsonpath={.items[0].status.podIP}")
        through_gateway = wait_until(lambda: (g := httpx.post(f"http://{require_loopback(gateway_ip)}:8080/v1/completions", timeout=60, json={
            "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})).status_code == 200 and g,
            timeout=30, what="a completion through the gateway pod")
        assert through_gateway.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
        # the KV column (.status.lastMetrics.kvCacheUtilization) comes from Prometheus: scraped every 5 s,
        # read at the autoscaler's interval
        kv = wait_until(lambda: kubectl("get", "kvis", "smollm2", "-o", "jsonpath={.status.lastMetrics.kvCacheUtilization}"),
                        timeout=90, what="KV column filled")
        assert 0 <= float(kv) <= 1
        assert kubectl("get", "kvis", "smollm2", "--no-headers").split()[:9] == ["smollm2", "smollm2-135m", "kvpilot", "1", "Serving", "1", "1", kv,
                                                                                    kubectl("get", "kvis", "smollm2", "-o", "jsonpath={.status.lastMetrics.queueDepth}")]
        if runtime == "podman":  # the engine's container goes with its pod (the operators stay)
            kubectl("delete", "kvis", "smollm2", "--wait=false")
            wait_until(lambda: not any(n.startswith(f"kvpilot-pod-{uid[:13]}-") for n in containers()), timeout=90,
                       what="the engine's container stopped")
    finally:
        down = subprocess.run([sys.executable, "-m", "e2e.cluster", "down", "--name", name], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    time.sleep(1)
    # the control plane, Prometheus and the pod runner; the engine; the operators (this cluster's Prometheus in their args)
    if runtime == "podman":
        assert not containers(), "containers left after down"
    for pattern in (f"cluster/{name}", f"--host {pod_ip} ", f"kvpilot.operator --prometheus-url={prometheus}", f"--host {gateway_ip} "):
        left = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        assert not left, f"processes matching {pattern!r} left after down: {left}"
