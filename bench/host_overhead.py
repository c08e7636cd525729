"""The engine's host work per decode step: everything a step does besides the model's forward pass,
the LM head and sampling (scheduling, building the ModelInput and its tensors, output processing,
detokenizing, the Python around them). On a GPU with CUDA graphs the forward is one graph replay
(~1.4 ms for this model's single stream, the GPU-path issue) and sampling a few kernels, so this host
time is what stands between the engine and the plain graph step unless it overlaps the GPU's work.

Measured on CPU, where the forward and sampling are synchronous and their time can be taken out
exactly: DecoderModel.forward, compute_logits and the Sampler call are timed; the rest of each step is
host work (sampling's own time is reported beside it: tensor work on a GPU, launched asynchronously).
With async scheduling (`--async-scheduling on`) the same host work overlaps the device's step on a GPU;
on a CPU nothing overlaps, so the figures show what the bookkeeping costs. These are upper bounds for
a GPU machine's host of the same speed: here each step's host work runs
right after a forward that has evicted it from the CPU's caches (InputBuilder.build takes ~45 µs in a
loop of its own, ~175 µs between forwards at one sequence).

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


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def measure(llm: LLM, batch: int, tokens: int) -> dict:
    runner = llm.engine.worker
    engine, model = llm.engine, runner.model
    spent = {"forward": 0.0, "sampling": 0.0}
    sampler = runner.sampler
    plain = {"forward": model.forward, "compute_logits": model.compute_logits, "draw": sampler.draw}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t
        return wrapper

    model.forward, model.compute_logits = timed(plain["forward"], "forward"), timed(plain["compute_logits"], "forward")
    sampler.draw = timed(plain["draw"], "sampling")  # the tensor work; reading its copy back is host work
    try:
        for i in range(batch):
            engine.add_request([1 + (7 * i + j) % 1000 for j in range(16)], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        engine.step()  # the prefill
        host, sampling, total = [], [], []
        while engine.has_unfinished_requests():
            spent.update(forward=0.0, sampling=0.0)
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            total.append(dt)
            sampling.append(spent["sampling"])
            host.append(dt - spent["forward"] - spent["sampling"])
    finally:
        model.forward, model.compute_logits, sampler.draw = plain["forward"], plain["compute_logits"], plain["draw"]
    return {"async scheduling": "on" if engine.async_scheduling else "off", "batch": batch, "decode steps": len(total), "host ms/step": f"{_median(host) * 1e3:.3f}",
            "host µs per sequence": f"{_median(host) * 1e6 / batch:.1f}", "sampling ms/step": f"{_median(sampling) * 1e3:.3f}",
            "whole step ms": f"{_median(total) * 1e3:.2f}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--async-scheduling", default="off,on", help="modes to measure (on a CPU the steps run at launch: the host "
                                                                   "work is what a GPU would overlap with its own)")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    rows = []
    for mode in args.async_scheduling.split(","):
        llm = LLM(show_progress=False, num_threads=1, kv_cache_memory="256MiB", max_num_seqs=256, async_scheduling=mode)
        measure(llm, 1, 8)  # warm-up
        rows += [measure(llm, int(b), args.tokens) for b in args.batches.split(",")]
    print(machine())
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
