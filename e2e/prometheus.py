"""A real Prometheus (upstream, built by e2e/tools/build.sh) run as a plain process with a generated config.

Pods are found through kubernetes_sd_configs against our apiserver; only pods annotated
prometheus.io/scrape=true with a loopback pod IP are scraped, labelled namespace/pod/inferenceservice.
Static targets serve tests that need exact, known series.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx

from e2e.cluster import binaries
from e2e.net import free_port, require_loopback
from kvpilot.operator.builders.manifests import METRICS_RELABELINGS


def prometheus_relabel(rule: dict) -> dict:
    """A PodMonitor relabeling (prometheus-operator's camelCase) as Prometheus's own relabel_config."""
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return {names.get(k, k): v for k, v in rule.items()}


def pod_scrape_config(api_server: str, token: str, ca_file: str, interval: str) -> dict:
    """The scrape job for engine pods: discovery and address as prometheus-operator would derive them from
    a PodMonitor, then the operator's own PodMonitor relabelings, so the autoscaler's queries are tested
    against the labels its PodMonitor really produces."""
    return {
        "job_name": "kubernetes-pods", "scrape_interval": interval, "scrape_timeout": interval,
        "kubernetes_sd_configs": [{"role": "pod", "api_server": api_server,
                                   "tls_config": {"ca_file": ca_file, "insecure_skip_verify": True},
                                   "authorization": {"credentials": token}}],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"], "regex": "true", "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_ip"], "regex": r"127\..+", "action": "keep"},  # loopback only here
            {"source_labels": ["__meta_kubernetes_pod_ip", "__meta_kubernetes_pod_annotation_prometheus_io_port"],
             "regex": r"(.+);(\d+)", "replacement": "$1:$2", "target_label": "__address__"},
            {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"], "regex": "(.+)", "target_label": "__metrics_path__"},
            *map(prometheus_relabel, METRICS_RELABELINGS),
        ],
    }


class Prometheus:
    def __init__(self, workdir: Path, scrape_interval: str = "1s"):
        self.workdir = Path(workdir)
        self.scrape_interval = scrape_interval
        self.port = 0
        self.jobs: list[dict] = []
        self.rule_files: list[str] = []
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_kubernetes_pods(self, api_server: str, token: str, ca_file: str) -> Prometheus:
        self.jobs.append(pod_scrape_config(require_loopback(api_server), token, ca_file, self.scrape_interval))
        return self

    def add_static(self, job: str, targets: list[str], labels: dict[str, str] | None = None) -> Prometheus:
        for t in targets:
            require_loopback(t)
        self.jobs.append({"job_name": job, "scrape_interval": self.scrape_interval, "scrape_timeout": self.scrape_interval,
                          "static_configs": [{"targets": targets, "labels": labels or {}}]})
        return self

    def add_rules(self, path: Path) -> Prometheus:
        self.rule_files.append(str(path))
        return self

    def start(self, timeout: float = 30) -> Prometheus:
        binary = binaries()["prometheus"]  # ToolMissing says how to build it
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self._write_config()
        log = open(self.workdir / "prometheus.log", "ab")
        self._proc = subprocess.Popen(
            [str(binary), f"--config.file={self.workdir / 'prometheus.yml'}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle", "--log.level=warn",
             "--storage.tsdb.retention.time=1h"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self._proc.returncode}):\n{(self.workdir / 'prometheus.log').read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("prometheus did not become ready")

    def reload(self) -> None:
        self._write_config()
        httpx.post(self.url + "/-/reload", timeout=5).raise_for_status()

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def query(self, promql: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def alerts(self) -> list[dict]:
        return httpx.get(self.url + "/api/v1/alerts", timeout=10).json()["data"]["alerts"]

    def targets(self) -> list[dict]:
        return httpx.get(self.url + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]

    def wait_for(self, promql: str, predicate=lambda r: bool(r), timeout: float = 30) -> list[dict]:
        deadline = time.monotonic() + timeout
        result: list[dict] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if predicate(result):
                return result
            time.sleep(0.5)
        raise TimeoutError(f"{promql!r} never satisfied the condition; last result {result}; targets {self.targets()}")

    def _write_config(self) -> None:
        # JSON is valid YAML: no YAML writer needed.
        cfg = {"global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
               "scrape_configs": self.jobs, "rule_files": self.rule_files}
        (self.workdir / "prometheus.yml").write_text(json.dumps(cfg, indent=1))


DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "kvpilot" / "dashboards" / "kvpilot.json"


def dashboard_queries(namespace: str, inferenceservice: str, model: str, rate_interval: str = "1m") -> dict[str, str]:
    """Every panel query of the chart's Grafana dashboard ("panel title / legend" -> PromQL), with the
    dashboard's variables as Grafana would fill them for one InferenceService."""
    dashboard = json.loads(DASHBOARD.read_text())
    values = {"$namespace": namespace, "$inferenceservice": inferenceservice, "$model": model, "$__rate_interval": rate_interval}
    out = {}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in values.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unfilled variable in {panel['title']}: {expr}"
            out[f"{panel['title']} / {target['legendFormat']}"] = expr
    return out
