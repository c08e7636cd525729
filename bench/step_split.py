"""Where a single-stream decode step's time goes with --quantization gguf: the whole engine step vs the
GGUF-block projections and the tied head alone at M = 1 (the same modules, called directly with one
activation row), on this machine's threads. The remainder is attention, RoPE, norms, sampling and the
engine's Python.

    .venv/bin/python bench/step_split.py [--threads 2] [--force]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from kvpilot.server.threads import OPENMP_ENV  # noqa: E402

os.environ.update({k: os.environ.get(k, v) for k, v in OPENMP_ENV.items()})

import torch  # noqa: E402
from common import machine, refuse_if_busy, table  # noqa: E402

from kvpilot.kernels.quantized import GGUFLinear  # noqa: E402
from kvpilot.server import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    llm = LLM(quantization="gguf", show_progress=False, num_threads=args.threads, kv_cache_memory="64MiB")
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate("Hello", params)
    best_step = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        llm.generate("The capital of France is", params)
        best_step = min(best_step, (time.perf_counter() - start) / args.tokens)
    projections = [m for m in llm.engine.worker.model.modules() if isinstance(m, GGUFLinear)]
    best_proj = float("inf")
    for _ in range(3):
        total = 0.0
        for m in projections:
            x = torch.randn(1, m.in_features)
            m(x)
            start = time.perf_counter()
            for _ in range(20):
                m(x)
            total += (time.perf_counter() - start) / 20
        best_proj = min(best_proj, total)
    print(machine(), f"{args.threads} threads")
    print(table([{"part": "engine step (single stream, per token)", "ms": f"{best_step * 1e3:.2f}"},
                 {"part": f"{len(projections)} GGUF projections + head at M = 1", "ms": f"{best_proj * 1e3:.2f}"},
                 {"part": "the rest (attention, RoPE, norms, sampling, Python)", "ms": f"{(best_step - best_proj) * 1e3:.2f}"}],
                ["part", "ms"]))


if __name__ == "__main__":
    main()
