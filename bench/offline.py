"""Offline throughput and single-stream decode: kvpilot vs HF transformers (fp32, same weights), one run.

    .venv/bin/python bench/offline.py [--skip-hf] [--force]

Workload (nano-vllm's protocol scaled to this machine): 64 requests, prompt lengths uniform in
[32, 512], output lengths uniform in [32, 256], seed 0, ignore_eos. HF runs requests sorted by prompt
length in static batches of 8/16/32/64 (left padding); only each request's own output tokens count.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from kvpilot.server.threads import OPENMP_ENV  # noqa: E402

# Before torch loads: kvpilot and HF run in this process under the engine's OpenMP settings.
os.environ.update({k: os.environ.get(k, v) for k, v in OPENMP_ENV.items()})

from common import machine, matmul_peak_gflops, offline_workload, refuse_if_busy, table  # noqa: E402


def workload_flops(cfg, prompts, outputs) -> float:
    """Forward FLOPs of the whole workload: linear layers per token, attention per (token, context),
    LM head per sampled token."""
    h, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = 2 * L * (h * (q + 2 * kv) + q * h + 3 * h * f)
    attn_per_ctx = 2 * 2 * L * q  # QK^T and PV, per context position
    total = 0.0
    for p, o in zip(prompts, outputs):
        n = len(p) + o
        total += per_token * n + attn_per_ctx * n * (n + 1) / 2 + 2 * h * cfg.vocab_size * o
    return total


def weight_bytes(cfg, bytes_per=4) -> float:
    h, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return bytes_per * (L * (h * (q + 2 * kv) + q * h + 3 * h * f) + h * cfg.vocab_size)


def bench_kvpilot(prompts, outputs, threads, quantization="none"):
    from kvpilot.server import LLM, SamplingParams

    llm = LLM(num_threads=threads, show_progress=False, max_num_seqs=64, max_num_batched_tokens=2048, quantization=quantization)
    llm.generate([list(range(100, 132))], SamplingParams(max_tokens=4))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    assert [len(o.outputs[0].token_ids) for o in outs] == outputs
    t = time.perf_counter()
    single = llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))[0]
    single_dt = time.perf_counter() - t
    return llm, sum(outputs) / dt, dt, len(single.outputs[0].token_ids) / single_dt


def bench_hf(prompts, outputs, threads, batch_sizes):
    import torch
    from transformers import AutoModelForCausalLM

    from kvpilot.server.model_files import resolve_model_path

    torch.set_num_threads(threads)
    path = resolve_model_path("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    gen = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    results = {}
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    with torch.inference_mode():
        for bs in batch_sizes:
            t = time.perf_counter()
            for start in range(0, len(order), bs):
                idx = order[start:start + bs]
                width = max(len(prompts[i]) for i in idx)
                ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in idx])
                mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx])
                steps = max(outputs[i] for i in idx)
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, **gen)
            results[bs] = sum(outputs) / (time.perf_counter() - t)
        t = time.perf_counter()
        model.generate(input_ids=torch.tensor([prompts[0][:32]]), max_new_tokens=256, min_new_tokens=256, **gen)
        single = 256 / (time.perf_counter() - t)
    return results, single


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-batch-sizes", default="8,16,32,64")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--quantization", default="none,gguf", help="kvpilot weight formats to run, comma-separated (none = fp32)")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    prompts, outputs = offline_workload()
    peak = matmul_peak_gflops(args.threads)
    rows, kvpilot = [], []
    for quantization in args.quantization.split(","):
        llm, tput, dt, single = bench_kvpilot(prompts, outputs, args.threads, quantization)
        cfg = llm.engine.model_config
        flops = workload_flops(cfg, prompts, outputs)
        wbytes = llm.engine.worker.model.weight_bytes()  # what one decode step reads
        del llm
        kvpilot.append((tput, single))
        rows.append({"system": f"kvpilot ({'fp32' if quantization == 'none' else quantization})", "output tok/s": f"{tput:.1f}", "vs HF best": "",
                     "FLOP/s": f"{flops / dt / 1e9:.1f} G", "of peak": f"{flops / dt / 1e9 / peak:.0%}", "single-stream tok/s": f"{single:.1f}",
                     "GB/s": f"{single * wbytes / 1e9:.1f}"})
    wbytes = weight_bytes(cfg)
    if not args.skip_hf:
        hf, hf_single = bench_hf(prompts, outputs, args.threads, [int(x) for x in args.hf_batch_sizes.split(",")])
        best = max(hf.values())
        for row, (tput, single) in zip(rows, kvpilot):
            row["vs HF best"] = f"{tput / best:.2f}x"
            row["single-stream tok/s"] += f" ({single / hf_single:.2f}x HF)"
        for bs, v in hf.items():
            rows.append({"system": f"HF transformers bs={bs}", "output tok/s": f"{v:.1f}", "vs HF best": f"{v / best:.2f}x"})
        rows.append({"system": "HF transformers bs=1", "single-stream tok/s": f"{hf_single:.1f}", "GB/s": f"{hf_single * wbytes / 1e9:.1f}"})
    print(f"machine: {machine()}; threads {args.threads}; fp32 matmul peak {peak:.0f} GFLOP/s")
    print(f"workload: 64 requests, {sum(map(len, prompts))} prompt + {sum(outputs)} output tokens, {flops / 1e12:.2f} TFLOP")
    print(table(rows, ["system", "output tok/s", "vs HF best", "FLOP/s", "of peak", "single-stream tok/s", "GB/s"]))


if __name__ == "__main__":
    main()
