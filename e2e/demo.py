"""`make demo`: the whole story on this machine, in one command.

Starts a local control plane (kwok GPU nodes), Prometheus (pod discovery), the operator, the pod
runner (real kvpilot engines on loopback pod IPs) and an autoscaled InferenceService (min 1, max 3,
short windows); then a bounded load generator. Prints a live timeline of replicas, KV-cache use,
queue depth and decisions while it scales up under load and back down after. Tears everything
down on exit or Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shlex
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
WINDOW_S = 10.0  # answers per second and TTFT p95 over this many seconds
KEPT_TIMELINE = ROOT / "bench" / "results" / "demo-timeline.json"  # the run bench/plots.py draws (docs/images/demo-timeline.png)


def _bench_common():
    """bench/common.py (the benchmarks' machine line), loaded by path: bench/ is not a package."""
    spec = importlib.util.spec_from_file_location("kvpilot_bench_common", ROOT / "bench" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _number(value) -> float | None:
    """A metric of status.lastMetrics (the operator writes them as decimal strings) as a number."""
    return None if value in (None, "") else float(value)


def sample(cluster: Cluster, t0: float, phase: str, seen: set, load: LoadGenerator | None) -> dict:
    """One point of the timeline (printed as a line): replicas asked and ready, the metrics the autoscaler
    read, its ScalingActive reason; the load's clients, answers per second and TTFT p95 over the last 10 s."""
    obj = json.loads(cluster.kubectl("get", "kvis", "demo", "-o", "json").stdout)
    st, spec = obj.get("status", {}), obj["spec"]
    m = st.get("lastMetrics") or {}
    active = next((c for c in st.get("conditions", []) if c["type"] == "ScalingActive"), {})
    now = time.monotonic()
    answered = load.answers() if load is not None else []
    firsts = sorted(ttft for at, _, ttft in answered if now - at <= WINDOW_S)  # TTFTs by when their first token came
    finished = sum(1 for _, done, _ in answered if now - done <= WINDOW_S)
    point = {"t": round(now - t0, 1), "phase": phase, "replicas": spec.get("replicas", spec["minReplicas"]),
             "ready": st.get("readyReplicas", 0), "kv_cache_utilization": _number(m.get("kvCacheUtilization")), "queue_depth": _number(m.get("queueDepth")),
             "clients": load.clients if load is not None and phase == "load" else 0, "answers_per_s": round(finished / WINDOW_S, 2),
             "first_tokens": len(firsts),  # the TTFTs behind ttft_p95_s (nearest rank: below 20 of them, their largest)
             "ttft_p95_s": round(firsts[math.ceil(0.95 * len(firsts)) - 1], 3) if firsts else None, "scaling": active.get("reason")}
    print(f"{point['t']:6.1f}s  {phase:<9} replicas {point['replicas']} (ready {point['ready']})  kv {m.get('kvCacheUtilization', '-'):>5}  "
          f"queue {m.get('queueDepth', '-'):>5}  TTFT p95 {point['ttft_p95_s'] if firsts else '-'} (of {len(firsts)})  "
          f"scaling {active.get('reason', '-')}", flush=True)
    for h in st.get("scalingHistory", []):
        key = (h["time"], h["from"], h["to"])
        if key not in seen:
            seen.add(key)
            print(f"         >>> {h['from']} -> {h['to']}: {h['reason']}", flush=True)
    return point


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make demo")
    ap.add_argument("--load-seconds", type=float, default=90)
    ap.add_argument("--cooldown-seconds", type=float, default=120)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--timeline", type=Path, help=f"where the timeline goes as JSON (default: the run's folder; {KEPT_TIMELINE.relative_to(ROOT)} "
                                                  "is the run the docs show: write there, then make plots)")
    args = ap.parse_args(argv)
    common = _bench_common()  # (loaded before the run: the timeline is written through it at the end)
    work = Path(tempfile.mkdtemp(prefix="kvpilot-demo-"))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    cluster = prom = runner = op = load = None
    t0 = time.monotonic()
    points: list[dict] = []
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
            points.append(sample(cluster, t0, "warmup", seen, load))
            obj = json.loads(cluster.kubectl("get", "kvis", "demo", "-o", "json").stdout)
            if obj.get("status", {}).get("readyReplicas", 0) >= 1:
                break
            time.sleep(2)
        api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        load = LoadGenerator(api, cluster.server, "default", "demo", clients=args.clients, max_tokens=64, max_seconds=args.load_seconds).start()
        end = time.monotonic() + args.load_seconds
        while time.monotonic() < end:
            points.append(sample(cluster, t0, "load", seen, load))
            time.sleep(2)
        load.stop()
        print(f"         load stopped: {dict(load.statuses)} responses, per pod {dict(load.sent)}", flush=True)
        end = time.monotonic() + args.cooldown_seconds
        while time.monotonic() < end:
            points.append(sample(cluster, t0, "cooldown", seen, load))
            obj = json.loads(cluster.kubectl("get", "kvis", "demo", "-o", "json").stdout)
            if obj["spec"].get("replicas", 1) == 1 and obj.get("status", {}).get("replicas") == 1 and len(seen) >= 2:
                break
            time.sleep(2)
        points.append(sample(cluster, t0, "done", seen, load))
        timeline = args.timeline or work / "timeline.json"
        timeline.parent.mkdir(parents=True, exist_ok=True)
        given = sys.argv[1:] if argv is None else argv
        common.save_results(timeline, "make demo" + (f" ARGS={shlex.quote(shlex.join(given))}" if given else ""), spec=SPEC,
                            scaling_history=[{"from": f, "to": to} for _, f, to in sorted(seen)], points=points,
                            responses={str(k): v for k, v in load.statuses.items()}, per_pod=dict(load.sent), answered=len(load.answered))
        print(f"timeline: {timeline}", flush=True)
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
