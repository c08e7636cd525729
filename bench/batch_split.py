"""Where a batch's time goes on CPU: requests run offline with max_num_seqs 16, and every part of the
step timed — the projections and attention by the rows of the call (over 16: a step with a prefill in
it, since at most 16 sequences decode; 16 or fewer: nearly always a decode-only step), the LM head (the
sampled rows only), RMSNorm, RoPE with the K/V store; the remainder is sampling, embedding, the
residual adds and the engine's Python.

    .venv/bin/python bench/batch_split.py [--workload serve|peers] [--dtype gguf|bfloat16] [--kv-cache-dtype auto]
                                          [--threads 2] [--force]

Workloads: `serve`, bench/serve.py's 16-client requests (32 prompts of 24-200 words, 64-128 tokens out);
`peers`, bench/peers.py's (vllm bench serve's random dataset: 64 prompts of 128-384 random token ids,
64-192 tokens out, ignore_eos). `--dtype gguf`: the bundled GGUF's blocks as stored (--quantization gguf);
`bfloat16`: the same weights as a Hugging Face checkpoint (bench/vllm_peer.py makes it), --dtype bfloat16.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from kvpilot.server.threads import OPENMP_ENV  # noqa: E402

os.environ.update({k: os.environ.get(k, v) for k, v in OPENMP_ENV.items()})

from common import machine, refuse_if_busy, table  # noqa: E402
from serve import workload  # noqa: E402

from kvpilot.kernels import linear as linear_module  # noqa: E402
from kvpilot.kernels.quantized import GGUFLinear  # noqa: E402
from kvpilot.server import LLM, SamplingParams  # noqa: E402


def peers_workload(n: int = 64, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(100, 49000) for _ in range(rng.randint(128, 384))], rng.randint(64, 192)) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=["serve", "peers"], default="serve")
    ap.add_argument("--dtype", choices=["gguf", "bfloat16"], default="gguf")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    seconds: dict[str, float] = collections.defaultdict(float)

    def timer(part: str, fn, rows_of=None):
        def timed(*a, **k):
            start = time.perf_counter()
            y = fn(*a, **k)
            label = part if rows_of is None else f"{part}, {'over 16 rows' if rows_of(*a) > 16 else '16 rows or fewer'}"
            seconds[label] += time.perf_counter() - start
            return y
        return timed

    common = dict(kv_cache_dtype=args.kv_cache_dtype, show_progress=False, num_threads=args.threads, max_num_seqs=16)
    if args.dtype == "gguf":
        llm = LLM(quantization="gguf", **common)
    else:
        from vllm_peer import hf_checkpoint

        llm = LLM(model=str(hf_checkpoint()), dtype="bfloat16", **common)
    model = llm.engine.worker.model
    head = model.lm_head

    def rows(x, *_):
        return x.reshape(-1, x.shape[-1]).shape[0]

    def part_of(module):
        return "LM head" if module is head else "projections"

    def projection_timer(fn):
        def timed(self, x, *a):  # (the LM head sees the sampled rows only: not split)
            return timer(part_of(self), fn, None if self is head else lambda s, x, *_: rows(x))(self, x, *a)
        return timed

    GGUFLinear._run = projection_timer(GGUFLinear._run)
    for name in ("forward", "silu", "mul", "add"):  # the dense (oneDNN) projections
        setattr(linear_module.Linear, name, projection_timer(getattr(linear_module.Linear, name)))
    linear_module.Linear.__call__ = linear_module.Linear.forward  # (direct_call bound the old forward)
    ops = {id(m.ops): m.ops for m in model.modules() if getattr(m, "ops", None) is not None}
    for o in ops.values():
        object.__setattr__(o, "paged_attention", timer("attention", o.paged_attention, lambda q, *_a, **_k: q.shape[0]))
        object.__setattr__(o, "rms_norm", timer("RMSNorm", o.rms_norm))
        object.__setattr__(o, "rotary_qkv_", timer("RoPE + K/V store", o.rotary_qkv_))
    reqs = peers_workload() if args.workload == "peers" else workload(32, 16000)
    llm.generate([p for p, _ in reqs[:2]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    seconds.clear()
    start = time.perf_counter()
    llm.generate([p for p, _ in reqs], [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs])
    wall = time.perf_counter() - start
    out_rows = [{"part": part, "s": f"{s:.2f}", "share": f"{s / wall:.0%}"} for part, s in sorted(seconds.items())]
    rest = wall - sum(seconds.values())
    tokens = sum(m for _, m in reqs)
    out_rows += [{"part": "the rest (sampling, embedding, residual adds, Python)", "s": f"{rest:.2f}", "share": f"{rest / wall:.0%}"},
                 {"part": f"all: {tokens} tokens out, {tokens / wall:.1f} tok/s", "s": f"{wall:.2f}", "share": "100%"}]
    print(f"machine: {machine()}, {args.threads} threads, {args.workload} workload, {args.dtype}, kv_cache_dtype {args.kv_cache_dtype}")
    print(table(out_rows, ["part", "s", "share"]))


if __name__ == "__main__":
    main()
