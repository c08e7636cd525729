"""`make demo`: the whole story on this machine, in one command.

Starts a local control plane (kwok GPU nodes), Prometheus (pod discovery), the operator, the pod
runner (real kvpilot engines on loopback pod IPs) and an autoscaled InferenceService (min 1, max 3,
short windows); then a bounded load generator. Prints a live timeline of replicas, KV-cache use,
queue depth and decisions while it scales up under load and back down after. Tears everything
down on exit or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from e2e.cluster import TOKEN, Cluster, _insecure
from e2e.load import LoadGenerator
from e2e.operator_proc import OperatorProcess
from e2e.pod_runner import PodRunner
from e2e.prometheus import Prometheus

ROOT = Path(__file__).resolve().parents[1]
SPEC = {"model": {"source": "smollm2-135m"}, "minReplicas": 1, "maxReplicas": 3,
        "engineSettings": {"maxNumSeqs": 2, "kvCacheMemory": "64MiB", "maxModelLen": 1024},
        "autoscaling": {"targetQueueDepth": 1.0, "targetKvCacheUtilization": 0.9, "intervalSeconds": 3,
                        "scaleDownStabilizationSeconds": 30, "metricsStaleAfterSeconds": 15}}


def line(cluster: Cluster, t0: float, phase: str, seen: set) -> None:
    obj = json.loads(cluster.kubectl("get", "kvis", "demo", "-o", "json").stdout)
    st, spec = obj.get("status", {}), obj["spec"]
    m = st.get("lastMetrics") or {}
    active = next((c for c in st.get("conditions", []) if c["type"] == "ScalingActive"), {})
    print(f"{time.monotonic() - t0:6.1f}s  {phase:<9} replicas {spec.get('replicas', spec['minReplicas'])} "
          f"(ready {st.get('readyReplicas', 0)})  kv {m.get('kvCacheUtilization', '-'):>5}  queue {m.get('queueDepth', '-'):>5}  "
          f"scaling {active.get('reason', '-')}", flush=True)
    for h in st.get("scalingHistory", []):
        key = (h["time"], h["from"], h["to"])
        if key not in seen:
            seen.add(key)
            print(f"         >>> {h['from']} -> {h['to']}: {h['reason']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make demo")
    ap.add_argument("--load-seconds", type=float, default=90)
    ap.add_argument("--cooldown-seconds", type=float, default=120)
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvpilot-demo-"))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    cluster = prom = runner = op = load = None
    t0 = time.monotonic()
    try:
        print("starting the control plane (etcd, apiserver, controller-manager, scheduler, kwok: 3 GPU nodes)...", flush=True)
        cluster = Cluster("demo").up(nodes=3, gpus_per_node=4)
        cluster.kubectl("apply", "-f", str(ROOT / "crds"))
        print(f"  up in {time.monotonic() - t0:.1f}s; export KUBECONFIG={cluster.kubeconfig} to look around", flush=True)
        prom = Prometheus(work / "prometheus", "1s").add_kubernetes_pods(cluster.server, TOKEN, str(cluster.state_dir / "certs" / "apiserver.crt")).start()
        print(f"prometheus at {prom.url} (discovers engine pods through the apiserver)", flush=True)
        runner = PodRunner(cluster.server, work / "engines").start()
        op = OperatorProcess(cluster.kubeconfig, work / "operator.log", args=["--prometheus-url", prom.url])
        print(f"operator and pod runner started (logs in {work})", flush=True)
        cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService",
                                                             "metadata": {"name": "demo"}, "spec": SPEC}))
        print("InferenceService 'demo' applied: min 1, max 3, target queue 1/pod, windows of seconds (test-sized)\n", flush=True)
        seen: set = set()
        while True:  # warm-up: the first engine loads the model
            line(cluster, t0, "warmup", seen)
            obj = json.loads(cluster.kubectl("get", "kvis", "demo", "-o", "json").stdout)
            if obj.get("status", {}).get("readyReplicas", 0) >= 1:
                break
            time.sleep(2)
        api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        load = LoadGenerator(api, cluster.server, "default", "demo", clients=args.clients, max_tokens=64, max_seconds=args.load_seconds).start()
        end = time.monotonic() + args.load_seconds
        while time.monotonic() < end:
            line(cluster, t0, "load", seen)
            time.sleep(2)
        load.stop()
        print(f"         load stopped: {dict(load.statuses)} responses, per pod {dict(load.sent)}", flush=True)
        end = time.monotonic() + args.cooldown_seconds
        while time.monotonic() < end:
            line(cluster, t0, "cooldown", seen)
            obj = json.loads(cluster.kubectl("get", "kvis", "demo", "-o", "json").stdout)
            if obj["spec"].get("replicas", 1) == 1 and obj.get("status", {}).get("replicas") == 1 and len(seen) >= 2:
                break
            time.sleep(2)
        line(cluster, t0, "done", seen)
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted", flush=True)
        return 130
    finally:
        print("tearing down...", flush=True)
        for part in (load, op, runner, prom):
            if part is not None:
                try:
                    part.stop()
                except Exception as e:  # noqa: BLE001 - keep tearing down
                    print(f"  {type(part).__name__}: {e}", flush=True)
        if cluster is not None:
            cluster.down(keep_logs=True)
        print("done.", flush=True)


if __name__ == "__main__":
    sys.exit(main())
