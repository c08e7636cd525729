"""Where a batch's time goes with --quantization gguf: bench/serve.py's 16-client requests (32 prompts of
24-200 words, 64-128 tokens out) run offline with max_num_seqs 16, and every GGUF projection call
timed by its row count (prefill-sized calls vs decode steps, the LM head apart). The remainder is
attention, RoPE, norms, sampling and the engine's Python.

    .venv/bin/python bench/batch_split.py [--kv-cache-dtype auto] [--threads 2] [--force]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from kvpilot.server.threads import OPENMP_ENV  # noqa: E402

os.environ.update({k: os.environ.get(k, v) for k, v in OPENMP_ENV.items()})

from common import machine, refuse_if_busy, table  # noqa: E402
from serve import workload  # noqa: E402

from kvpilot.kernels.quantized import GGUFLinear  # noqa: E402
from kvpilot.server import LLM, SamplingParams  # noqa: E402

BUCKETS = ((2, "1-2 rows"), (16, "3-16 rows"), (64, "17-64 rows"), (float("inf"), "65+ rows"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
    run = GGUFLinear._run

    def timed(self, x, epilogue, other=None):
        start = time.perf_counter()
        y = run(self, x, epilogue, other)
        m = x.reshape(-1, x.shape[-1]).shape[0]
        part = "LM head" if self is head else "projections"
        seconds[part, next(name for top, name in BUCKETS if m <= top)] += time.perf_counter() - start
        return y

    llm = LLM(quantization="gguf", kv_cache_dtype=args.kv_cache_dtype, show_progress=False, num_threads=args.threads, max_num_seqs=16)
    head = llm.engine.worker.model.lm_head
    GGUFLinear._run = timed
    reqs = workload(32, 16000)
    llm.generate([p for p, _ in reqs[:2]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    seconds.clear()
    start = time.perf_counter()
    llm.generate([p for p, _ in reqs], [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs])
    wall = time.perf_counter() - start
    rows = [{"part": f"{part}, {bucket}", "s": f"{s:.2f}", "share": f"{s / wall:.0%}"} for (part, bucket), s in sorted(seconds.items())]
    rest = wall - sum(seconds.values())
    rows += [{"part": "the rest (attention, RoPE, norms, sampling, Python)", "s": f"{rest:.2f}", "share": f"{rest / wall:.0%}"},
             {"part": f"all: {sum(m for _, m in reqs)} tokens out, {sum(m for _, m in reqs) / wall:.1f} tok/s", "s": f"{wall:.2f}", "share": "100%"}]
    print(f"machine: {machine()}, {args.threads} threads, kv_cache_dtype {args.kv_cache_dtype}")
    print(table(rows, ["part", "s", "share"]))


if __name__ == "__main__":
    main()
