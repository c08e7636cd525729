"""Runs the operator (python -m kvpilot.operator) as a local process against the e2e control plane,
optionally as a ServiceAccount (a real token from the TokenRequest API)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from e2e.cluster import Cluster


def service_account_kubeconfig(cluster: Cluster, namespace: str, sa: str, path: Path) -> Path:
    token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=2h").stdout.strip()
    cfg = json.loads(cluster.kubeconfig.read_text())
    cfg["users"] = [{"name": "admin", "user": {"token": token}}]
    path.write_text(json.dumps(cfg))
    return path


class OperatorProcess:
    """lease_namespace: where its leader-election Lease lives (the chart's namespace for its ServiceAccount);
    a short lease so that a test's next operator takes over quickly after one that was killed."""

    def __init__(self, kubeconfig: Path, log_path: Path, env: dict | None = None, args: list[str] | None = None,
                 lease_namespace: str = "default", lease_seconds: float = 4.0):
        self.log_path = log_path
        self._log = open(log_path, "ab")
        full_env = {**os.environ, "KUBECONFIG": str(kubeconfig), **(env or {})}
        lease = ["--leader-election-namespace", lease_namespace, "--lease-duration-seconds", str(lease_seconds)]
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpilot.operator", "--liveness", "", *lease, *(args or [])],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
