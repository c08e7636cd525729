"""Cold starts on the local control plane, with and without the model cache: the bundled model (98 MB
GGUF) served as hf://org/smol/smol.gguf by a loopback hub; one InferenceService per mode (PerPod: the
pod's init container downloads it; Shared: the entry, filled once before the rounds, is mounted), each
scaled 0 -> 1 -> 0 per round, modes alternating. Per start: seconds from replicas 1 to a first token
(client side) and the operator's status.lastColdStart phases; medians over the rounds.

    .venv/bin/python bench/cold_start.py --rounds 5 [--json bench/results/cold-start.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import machine, refuse_if_busy, save_results, table  # noqa: E402
from e2e.cluster import TOKEN, Cluster, _insecure  # noqa: E402
from e2e.hub import LoopbackHub, smol_hub  # noqa: E402
from e2e.isvc import apply_isvc, get_isvc  # noqa: E402
from e2e.load import ready_endpoints  # noqa: E402
from e2e.operator_proc import OperatorProcess  # noqa: E402
from e2e.pod_runner import PodRunner  # noqa: E402
from e2e.waiting import wait_until  # noqa: E402
from kvpilot.server.model_files import resolve_model_path  # noqa: E402

NS = "bench"
PHASES = ["scheduling", "model", "import", "load", "warmup", "listen", "ready"]


def service(hub: LoopbackHub, mode: str, replicas: int) -> dict:
    cache = {"mode": mode} if mode == "PerPod" else {"mode": mode, "storageClassName": "kvpilot-local", "size": "1Gi"}
    return {"model": {"source": "hf://org/smol/smol.gguf", "servedName": "smol", "cache": cache}, "replicas": replicas, "minReplicas": 0,
            "maxReplicas": 1, "autoscaling": {"enabled": False}, "resources": {"cpuOnly": True}, "env": [{"name": "HF_ENDPOINT", "value": hub.url}],
            "engineSettings": {"kvCacheMemory": "16MiB", "maxModelLen": 256}}


def start_once(cluster: Cluster, api: httpx.Client, hub: LoopbackHub, name: str, mode: str, previous: str | None) -> dict:
    t = time.monotonic()
    apply_isvc(cluster, NS, name, service(hub, mode, 1))

    def answered():
        for endpoint in ready_endpoints(api, cluster.server, NS, name):
            return httpx.post(f"{endpoint}/v1/completions", timeout=30, json={"model": "smol", "prompt": "Hi", "max_tokens": 1}).status_code == 200
        return False

    wait_until(answered, timeout=180, interval=0.1, what=f"{name}: first token")
    first_token = time.monotonic() - t
    started = wait_until(lambda: (lambda c: c if c and c["pod"] != previous else None)(
        ((get_isvc(cluster, NS, name) or {}).get("status") or {}).get("lastColdStart")), timeout=30, what=f"{name}: cold start in status")
    apply_isvc(cluster, NS, name, service(hub, mode, 0))
    wait_until(lambda: not ready_endpoints(api, cluster.server, NS, name), timeout=90, what=f"{name}: back to 0")
    return {"first_token": first_token, "total": started["totalSeconds"], "pod": started["pod"],
            **{p["name"]: p["seconds"] for p in started["phases"]}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the medians and every start here too (bench/results/: make plots draws them)")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(name="bench-cold-start", state_dir=Path(tmp) / "cluster").up(nodes=1)
        hub = smol_hub(resolve_model_path("smollm2-135m"))
        runner = op = None
        try:
            cluster.kubectl("apply", "-f", str(ROOT / "crds"))
            cluster.kubectl("create", "namespace", NS)
            cluster.add_host_volumes(2, Path(tmp) / "volumes", prefix="bench")
            runner = PodRunner(cluster.server, Path(tmp) / "pods").start()
            op = OperatorProcess(cluster.kubeconfig, Path(tmp) / "operator.log")
            api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
            apply_isvc(cluster, NS, "cached", service(hub, "Shared", 0))
            apply_isvc(cluster, NS, "plain", service(hub, "PerPod", 0))
            wait_until(lambda: (((get_isvc(cluster, NS, "cached") or {}).get("status") or {}).get("modelCache") or [{}])[0].get("state") == "Ready",
                       timeout=120, what="the cache entry filled")
            runs: dict[str, list[dict]] = {"PerPod": [], "Shared": []}
            last = {"plain": None, "cached": None}
            for r in range(args.rounds):
                for name, mode in (("plain", "PerPod"), ("cached", "Shared")) if r % 2 == 0 else (("cached", "Shared"), ("plain", "PerPod")):
                    run = start_once(cluster, api, hub, name, mode, last[name])
                    last[name] = run["pod"]
                    runs[mode].append(run)
                    print(json.dumps({"mode": mode, **run}), flush=True)
            cols = ["first_token", "total", *PHASES]
            rows = [{"mode": mode, "starts": len(rs), **{c: f"{statistics.median(x[c] for x in rs):.2f}" for c in cols}} for mode, rs in runs.items()]
            print(f"\n{machine()}; downloads from the hub: {len(hub.downloads)} ({args.rounds} uncached starts + 1 fill)")
            print(table(rows, ["mode", "starts", *cols]))
            if args.json:
                save_results(args.json, rounds=args.rounds, phases=list(PHASES), starts=runs,
                             results=[{"mode": mode, **{c: statistics.median(x[c] for x in rs) for c in cols}} for mode, rs in runs.items()])
        finally:
            if op is not None:
                op.stop()
            if runner is not None:
                runner.stop()
            hub.close()
            cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
