"""The README's local quick start, step by step, as a user runs it: `python -m e2e.cluster up` (what
`make cluster-up` runs) on its own cluster, the chart installed with the helm line it prints (its
operator and gateway pods run by the pod runner), the CPU example applied with kubectl, Ready, a
completion through the pod IP and through the gateway, the KV column filled from Prometheus, then `down` leaving no process behind."""

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
from e2e.waiting import wait_until

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]


def test_readme_local_quick_start(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))}
    up = subprocess.run([sys.executable, "-m", "e2e.cluster", "up", "--name", "quickstart"], cwd=ROOT, env=env,
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
        pod_ip = kubectl("get", "pods", "-l", "serving.kvpilot.dev/inferenceservice=smollm2", "-o", "jsonpath={.items[0].status.podIP}")
        r = httpx.post(f"http://{require_loopback(pod_ip)}:8000/v1/completions", timeout=60,
                       json={"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"], r.text
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
        assert kubectl("get", "kvis", "smollm2", "--no-headers").split()[:7] == ["smollm2", "1", "Serving", "1", "1", kv,
                                                                                    kubectl("get", "kvis", "smollm2", "-o", "jsonpath={.status.lastMetrics.queueDepth}")]
    finally:
        down = subprocess.run([sys.executable, "-m", "e2e.cluster", "down", "--name", "quickstart"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    time.sleep(1)
    # the control plane, Prometheus and the pod runner; the engine; the operators (this cluster's Prometheus in their args)
    for pattern in ("cluster/quickstart", f"--host {pod_ip} ", f"kvpilot.operator --prometheus-url={prometheus}", f"--host {gateway_ip} "):
        left = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        assert not left, f"processes matching {pattern!r} left after down: {left}"
