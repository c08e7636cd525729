"""LoRA adapters' cost: the same requests with four adapters (round robin) vs on the base model alone,
offline, single stream and served at --clients clients; and how long an adapter takes to load.

    .venv/bin/python bench/lora.py [--quantization none,gguf] [--rank 16] [--rounds 2] [--clients 16] [--force]

Adapters: PEFT's format (adapter_config.json + adapter_model.safetensors), rank --rank on all seven
projections of every layer, seeded random weights (speed does not depend on their values), written
under the cache. Offline: 64 requests (bench/common.py's workload), in one engine with 4 slots and no
prefix caching, base and adapter runs interleaved --rounds times (medians). Serving: one server, 2 x clients requests of
bench/serve.py's workload per repetition, base and adapters alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from kvpilot.server.threads import OPENMP_ENV  # noqa: E402

os.environ.update({k: os.environ.get(k, v) for k, v in OPENMP_ENV.items()})

from common import machine, offline_workload, refuse_if_busy, table  # noqa: E402
from serve import one, summary, wait_ready, workload  # noqa: E402

from kvpilot.kernels.cache import cache_root  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = 4


def make_adapters(rank: int) -> list[str]:
    import torch
    from safetensors.torch import save_file

    from kvpilot.server.engine.lora import target_shapes
    from kvpilot.server.loading import open_model
    from kvpilot.server.model_files import resolve_model_path

    config = open_model(resolve_model_path("smollm2-135m"))[0].config
    shapes = target_shapes(config)
    paths = []
    for a in range(ADAPTERS):
        d = cache_root() / "bench" / f"lora-r{rank}-{a}"
        paths.append(str(d))
        if (d / "adapter_model.safetensors").is_file():
            continue
        d.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(a)
        tensors = {}
        for layer in range(config.num_layers):
            for t in TARGETS:
                n_in, n_out = shapes[t]
                prefix = f"base_model.model.model.layers.{layer}.{'mlp' if t in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{t}"
                tensors[prefix + ".lora_A.weight"] = torch.randn(rank, n_in, generator=g) * n_in ** -0.5
                tensors[prefix + ".lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}))
    return paths


def offline(paths: list[str], quantization: str, rank: int, rounds: int) -> dict:
    from kvpilot.server import LLM, SamplingParams
    from kvpilot.server.adapters import LoRARequest

    # No prefix caching: the rounds repeat the same prompts, and a side's second round would find its
    # first round's blocks (an adapter's blocks are its own: the two sides would not hit alike).
    llm = LLM(num_threads=os.cpu_count(), show_progress=False, max_num_seqs=64, max_num_batched_tokens=2048, quantization=quantization,
              enable_lora=True, max_loras=ADAPTERS, max_lora_rank=rank, enable_prefix_caching=False)
    t = time.perf_counter()
    for i, p in enumerate(paths):
        llm.engine.lora.add(f"a{i}", p)
    load_s = (time.perf_counter() - t) / len(paths)
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    prompts, outputs = offline_workload()
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
    llm.generate([list(range(100, 132))] * 4, SamplingParams(max_tokens=4), lora_request=requests)  # warm-up
    runs: dict[str, list[float]] = {"base": [], "lora": []}
    single: dict[str, list[float]] = {"base": [], "lora": []}
    for r in range(rounds):
        for side in (["base", "lora"] if r % 2 == 0 else ["lora", "base"]):
            lr = [requests[i % ADAPTERS] for i in range(len(prompts))] if side == "lora" else None
            t = time.perf_counter()
            llm.generate(prompts, params, lora_request=lr)
            runs[side].append(sum(outputs) / (time.perf_counter() - t))
            t = time.perf_counter()
            llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                         lora_request=requests[0] if side == "lora" else None)
            single[side].append(128 / (time.perf_counter() - t))
            print(f"offline {quantization} round {r} {side}: {runs[side][-1]:.1f} tok/s, single stream {single[side][-1]:.1f}", file=sys.stderr)
    med = statistics.median
    return {"offline": {s: med(v) for s, v in runs.items()}, "single": {s: med(v) for s, v in single.items()}, "load_s": load_s}


async def serve_level(url: str, reqs: list[tuple[str, str, int]], clients: int) -> dict:
    import httpx

    sem = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4, max_keepalive_connections=0)) as client:
        async def guarded(model, prompt, n):
            async with sem:
                return await one(client, url, model, prompt, n)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(*r) for r in reqs))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    return summary(sum(r["tokens"] for r in ok), wall, [r["ttft"] for r in ok], [x for r in ok for x in r["itl"]], len(results) - len(ok))


def serving(paths: list[str], quantization: str, rank: int, clients: int, repeats: int) -> dict:
    import httpx

    url = "http://127.0.0.1:18195"
    cmd = [sys.executable, "-m", "kvpilot.server.cli", "serve", "--host", "127.0.0.1", "--port", "18195", "--num-threads", str(os.cpu_count()),
           "--max-num-seqs", str(clients), "--max-waiting-requests", "1000", "--quantization", quantization, "--enable-lora", "--max-loras",
           str(ADAPTERS), "--max-lora-rank", str(rank), "--lora-modules", *(f"a{i}={p}" for i, p in enumerate(paths))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict[str, list[dict]] = {"base": [], "lora": []}
    try:
        wait_ready(url, "/ready", proc)
        httpx.post(url + "/v1/completions", json={"model": "a0", "prompt": "warm up", "max_tokens": 4}, timeout=120)
        for rep in range(repeats):
            reqs = workload(2 * clients, seed=2000 + rep)
            for side in (["base", "lora"] if rep % 2 == 0 else ["lora", "base"]):
                models = ["smollm2-135m"] * len(reqs) if side == "base" else [f"a{i % ADAPTERS}" for i in range(len(reqs))]
                out[side].append(asyncio.run(serve_level(url, [(m, p, n) for m, (p, n) in zip(models, reqs)], clients)))
                print(f"serve {quantization} rep {rep} {side}: {out[side][-1]['tok/s']:.1f} tok/s", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(30)
    return {s: statistics.median(r["tok/s"] for r in runs) for s, runs in out.items()} | {
        "errors": sum(r["errors"] for runs in out.values() for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="none,gguf", help="base weight formats, comma-separated (none = fp32)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="offline runs per side")
    ap.add_argument("--repeats", type=int, default=2, help="serving repetitions per side")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    paths = make_adapters(args.rank)
    rows = []
    for q in args.quantization.split(","):
        o = offline(paths, q, args.rank, args.rounds)
        s = None if args.skip_serve else serving(paths, q, args.rank, args.clients, args.repeats)
        ratio = lambda d: f"{d['lora']:.1f} / {d['base']:.1f} = {d['lora'] / d['base']:.2f}x"
        rows.append({"weights": "fp32" if q == "none" else q, "offline tok/s (4 adapters / base)": ratio(o["offline"]),
                     "single stream tok/s": ratio(o["single"]),
                     f"serve {args.clients} clients tok/s": ratio(s) if s else "-", "errors": s["errors"] if s else "-",
                     "adapter load s": f"{o['load_s']:.2f}"})
    print(f"machine: {machine()}; rank {args.rank}, {ADAPTERS} adapters on all seven projections")
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
