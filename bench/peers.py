"""kvpilot against vLLM's CPU build and llama.cpp's server, all driven by vLLM's own load generator.

    .venv/bin/python bench/peers.py [--model smollm2-135m|gemma3-270m] [--levels 1,16] [--repeats 2]
                                    [--servers kvpilot-gguf,kvpilot-bf16,vllm,llama] [--json OUT] [--force]

Every server gets the same requests from `vllm bench serve` (one client for all, not ours): the random
dataset, 256 prompt tokens and 128 output tokens, each ±50 %, ignore_eos, temperature 0, streamed
completions; 8 prompts at one client, 4 per client above (64 at 16). The servers, for the bundled model
--model (SmolLM2-135M, Q4_1; or Gemma 3 270M, Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0):
- kvpilot gguf: the bundled GGUF, its blocks as stored (`--quantization gguf`);
- kvpilot bf16: the same weights as a Hugging Face checkpoint (bfloat16 safetensors), `--dtype bfloat16`;
- kvpilot fp32 (not in the default set): that checkpoint computed in float32, the CPU default (for a CPU without
  AVX-512, where no fast kernel takes bfloat16);
- vLLM 0.32's CPU build on that checkpoint, bfloat16 (its venv and the checkpoint are made on first use
  by bench/vllm_peer.py);
- llama-server on the GGUF as stored (built on first use by bench/serve.py), 2048 tokens of context per
  slot (the workload's longest request is 384 + 192 tokens by vLLM's tokenizer; llama.cpp's may count more).
Each server on 2 threads, 16 sequences at most. They run side by side, idle between their turns (the
idle CPU use of each is printed); each level's repetitions run interleaved across the servers in a
rotating order with a fresh seed per repetition. Per level and server: output tok/s (all repetitions'
tokens over their summed durations), TTFT and ITL p50 over all samples, failed requests; then each
server's ratio against vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine, refuse_if_busy, save_results, table  # noqa: E402
from serve import llama_server_binary, tree_cpu_seconds, wait_ready  # noqa: E402
from vllm_peer import VLLM_VERSION, hf_checkpoint, vllm_env, vllm_python  # noqa: E402

from kvpilot.server.threads import OPENMP_ENV  # noqa: E402

MAX_SEQS = 16
FILE_TYPES = {"smollm2-135m": "Q4_1", "gemma3-270m": "Q4_K_M"}  # what llama-server is labelled by
LOAD = ["--backend", "openai", "--endpoint", "/v1/completions", "--dataset-name", "random", "--random-input-len", "256",
        "--random-output-len", "128", "--random-range-ratio", "0.5", "--ignore-eos", "--temperature", "0"]


def servers(model: str, checkpoint: Path, vllm: Path, llama: bool) -> dict[str, tuple[list[str], int, str, dict]]:
    """name -> (command line, port, readiness path, environment); llama-server's (built on first use) when `llama`."""
    from kvpilot.server.model_files import resolve_model_path

    gguf = resolve_model_path(model)
    gguf = gguf if gguf.is_file() else next(gguf.glob("*.gguf"))
    kvpilot = [str(Path(sys.executable).parent / "kvpilot"), "serve", "--host", "127.0.0.1", "--num-threads", "2",
               "--max-num-seqs", str(MAX_SEQS), "--max-waiting-requests", "1000", "--served-model-name", model]
    # llama-server (an OpenMP build) as shipped: the runtime's OpenMP defaults, not kvpilot's policy (server/threads.py)
    plain = {k: v for k, v in os.environ.items() if k not in OPENMP_ENV}
    return {
        "kvpilot gguf": ([*kvpilot, "--model", model, "--quantization", "gguf"], 18280, "/ready", plain),
        "kvpilot bf16": ([*kvpilot, "--model", str(checkpoint), "--dtype", "bfloat16"], 18281, "/ready", plain),
        "kvpilot fp32": ([*kvpilot, "--model", str(checkpoint)], 18287, "/ready", plain),
        "kvpilot gguf, core process": ([*kvpilot, "--model", model, "--quantization", "gguf", "--engine-core-process"], 18284, "/ready", plain),
        "kvpilot bf16, core process": ([*kvpilot, "--model", str(checkpoint), "--dtype", "bfloat16", "--engine-core-process"], 18286, "/ready", plain),
        "kvpilot gguf, bf16 KV": ([*kvpilot, "--model", model, "--quantization", "gguf", "--kv-cache-dtype", "bfloat16"], 18285, "/ready", plain),
        f"vLLM {VLLM_VERSION} CPU bf16": ([str(vllm), "-m", "vllm.entrypoints.cli.main", "serve", str(checkpoint), "--served-model-name", model,
                                          "--dtype", "bfloat16", "--max-num-seqs", str(MAX_SEQS), "--max-model-len", "2048",
                                          "--host", "127.0.0.1"], 18282, "/health", vllm_env(2)),
        **({f"llama-server {FILE_TYPES[model]}": ([str(llama_server_binary()), "-m", str(gguf), "--alias", model, "-t", "2", "--parallel", str(MAX_SEQS),
                                  "-c", str(2048 * MAX_SEQS), "--cont-batching", "--host", "127.0.0.1"], 18283, "/health", plain)} if llama else {}),
    }


def bench_serve(vllm: Path, port: int, checkpoint: Path, clients: int, prompts: int, seed: int, out: Path, model: str) -> dict:
    """One `vllm bench serve` run; its detailed result JSON."""
    name = f"{port}-{clients}-{seed}.json"
    cmd = [str(vllm), "-m", "vllm.entrypoints.cli.main", "bench", "serve", *LOAD, "--base-url", f"http://127.0.0.1:{port}",
           "--model", model, "--tokenizer", str(checkpoint), "--num-prompts", str(prompts), "--max-concurrency", str(clients),
           "--seed", str(seed), "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", name, "--disable-tqdm"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=vllm_env(2), cwd=out)
    if r.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.loads((out / name).read_text())


def pooled(runs: list[dict]) -> dict:
    """Repetitions of one level as one: tokens over summed durations, medians over every sample."""
    def p50(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] * 1000 if xs else float("nan")

    ok = [(ttft, itl) for run in runs for ttft, itl, err in zip(run["ttfts"], run["itls"], run["errors"]) if not err]
    return {"tok/s": sum(r["total_output_tokens"] for r in runs) / sum(r["duration"] for r in runs),
            "ttft_p50": p50([t for t, _ in ok]), "itl_p50": p50([x for _, itl in ok for x in itl]),
            "failed": sum(r["failed"] for r in runs), "runs": [r["output_throughput"] for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(FILE_TYPES), help="the bundled model every server serves")
    ap.add_argument("--levels", default="1,16")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repetitions of each level per server")
    ap.add_argument("--servers", help="comma-separated, of: kvpilot-gguf, kvpilot-bf16, vllm, llama (the default: these four), "
                                      "kvpilot-gguf-core, kvpilot-bf16-core (--engine-core-process), kvpilot-gguf-bf16kv (--kv-cache-dtype bfloat16), "
                                      "kvpilot-fp32 (the bf16 checkpoint computed in float32: the CPU default, for CPUs without AVX512-BF16)")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    keys = {"kvpilot-gguf": "kvpilot gguf", "kvpilot-bf16": "kvpilot bf16", "vllm": f"vLLM {VLLM_VERSION} CPU bf16",
            "llama": f"llama-server {FILE_TYPES[args.model]}", "kvpilot-gguf-core": "kvpilot gguf, core process",
            "kvpilot-bf16-core": "kvpilot bf16, core process", "kvpilot-gguf-bf16kv": "kvpilot gguf, bf16 KV",
            "kvpilot-fp32": "kvpilot fp32"}
    wanted = args.servers.split(",") if args.servers else ["kvpilot-gguf", "kvpilot-bf16", "vllm", "llama"]
    if unknown := [w for w in wanted if w not in keys]:
        raise SystemExit(f"unknown server(s) {', '.join(unknown)}: choose from {', '.join(keys)}")
    vllm, checkpoint = vllm_python(), hf_checkpoint(args.model)  # vllm bench serve drives every server: always set up
    every = servers(args.model, checkpoint, vllm, llama="llama" in wanted)
    chosen = {keys[w]: every[keys[w]] for w in wanted}
    levels = [int(x) for x in args.levels.split(",")]
    procs: dict[str, subprocess.Popen] = {}
    runs: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-peers-") as tmp:
        out = Path(tmp)
        try:
            for name, (cmd, port, ready, env) in chosen.items():
                procs[name] = subprocess.Popen([*cmd, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                               cwd=tmp)
                wait_ready(f"http://127.0.0.1:{port}", ready, procs[name], timeout=600)
                bench_serve(vllm, port, checkpoint, 2, 2, 1, out, args.model)  # warm-up
            time.sleep(2)
            idle = {name: tree_cpu_seconds(p.pid) for name, p in procs.items()}
            time.sleep(5)
            for name, p in procs.items():
                print(f"idle: {name} used {tree_cpu_seconds(p.pid) - idle[name]:.2f} CPU s in 5 s", file=sys.stderr, flush=True)
            names = list(chosen)
            for clients in levels:
                prompts = 8 if clients == 1 else 4 * clients
                for rep in range(args.repeats):
                    for name in names[rep % len(names):] + names[:rep % len(names)]:
                        run = bench_serve(vllm, chosen[name][1], checkpoint, clients, prompts, 1000 * clients + rep, out, args.model)
                        runs.setdefault((name, clients), []).append(run)
                        print(f"{name} clients={clients} rep={rep}: {run['output_throughput']:.1f} tok/s, TTFT p50 "
                              f"{run['median_ttft_ms']:.0f} ms, ITL p50 {run['median_itl_ms']:.1f} ms, failed {run['failed']}",
                              file=sys.stderr, flush=True)
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    results = {(name, c): pooled(runs[name, c]) for name in chosen for c in levels}
    rows = [{"server": name, "clients": c, "output tok/s": f"{r['tok/s']:.1f}", "TTFT p50 ms": f"{r['ttft_p50']:.0f}",
             "ITL p50 ms": f"{r['itl_p50']:.1f}", "failed": r["failed"], "per repetition tok/s": " / ".join(f"{x:.1f}" for x in r["runs"])}
            for (name, c), r in results.items()]
    base = next((n for n in chosen if n.startswith("vLLM")), None)
    for name in chosen:
        if base is None or name == base:
            continue
        for c in levels:
            a, b = results[name, c], results[base, c]
            rows.append({"server": f"{name} / vLLM", "clients": c, "output tok/s": f"**{a['tok/s'] / b['tok/s']:.2f}×**",
                         "TTFT p50 ms": f"{a['ttft_p50'] / b['ttft_p50']:.2f}×", "ITL p50 ms": f"{a['itl_p50'] / b['itl_p50']:.2f}×",
                         "failed": "", "per repetition tok/s": ""})
    print(f"model: {args.model}; machine: {machine()}")
    print(table(rows, ["server", "clients", "output tok/s", "TTFT p50 ms", "ITL p50 ms", "failed", "per repetition tok/s"]))
    if args.json:
        save_results(args.json, model=args.model, results=[{"server": n, "clients": c, **r} for (n, c), r in results.items()])


if __name__ == "__main__":
    main()
