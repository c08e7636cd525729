"""The engine's host work per decode step: everything a step does besides the model's forward pass
and LM head (scheduling, building the ModelInput and its tensors, sampling, output processing,
detokenizing). On a GPU with CUDA graphs the forward is one graph replay (~1.4 ms for this model's
single stream, the GPU-path issue), so this host time is what stands between the engine and the
plain graph step unless it overlaps with the GPU's work.

Measured on CPU, where the forward is synchronous and its time can be taken out exactly: the
forward is timed around DecoderModel.forward and compute_logits; the rest of each step is host work.

    .venv/bin/python bench/host_overhead.py [--batches 1,16,64] [--force]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import machine, refuse_if_busy, table  # noqa: E402

from kvpilot.server import LLM, SamplingParams  # noqa: E402


def measure(llm: LLM, batch: int, tokens: int) -> dict:
    engine, model = llm.engine, llm.engine.runner.model
    forward_time = [0.0]
    plain_forward, plain_logits = model.forward, model.compute_logits

    def timed(fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                forward_time[0] += time.perf_counter() - t
        return wrapper

    model.forward, model.compute_logits = timed(plain_forward), timed(plain_logits)
    try:
        for i in range(batch):
            engine.add_request([1 + (7 * i + j) % 1000 for j in range(16)], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        engine.step()  # the prefill
        steps, host, total = 0, [], []
        while engine.has_unfinished_requests():
            forward_time[0] = 0.0
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            steps += 1
            total.append(dt)
            host.append(dt - forward_time[0])
    finally:
        model.forward, model.compute_logits = plain_forward, plain_logits
    host.sort()
    total.sort()
    return {"batch": batch, "decode steps": steps, "host ms/step (median)": f"{host[len(host) // 2] * 1e3:.3f}",
            "host µs per sequence": f"{host[len(host) // 2] * 1e6 / batch:.0f}", "whole step ms (median)": f"{total[len(total) // 2] * 1e3:.2f}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    llm = LLM(show_progress=False, num_threads=1, kv_cache_memory="256MiB", max_num_seqs=256)
    measure(llm, 1, 8)  # warm-up
    rows = [measure(llm, int(b), args.tokens) for b in args.batches.split(",")]
    print(machine())
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
