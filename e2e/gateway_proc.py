"""Runs kvpilot-gateway (python -m kvpilot.operator.gateway) as a local process against the e2e control plane."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from e2e.net import free_port
from e2e.waiting import wait_until


class GatewayProcess:
    def __init__(self, kubeconfig: Path, namespace: str, log_path: Path, args: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpilot.operator.gateway", "--host", "127.0.0.1", "--port", str(self.port),
                                      "--namespace", namespace, *(args or [])],
                                     stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "KUBECONFIG": str(kubeconfig)}, start_new_session=True)
        wait_until(self._healthy, timeout=30, what="kvpilot-gateway answers /health")

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"kvpilot-gateway exited with {self.proc.returncode}")
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
