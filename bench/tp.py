"""Tensor parallelism on this machine: SmolLM2-135M with 1 rank vs 3 ranks (gloo, one thread per
rank), single stream and 8 streams of greedy decode, and what the communication costs per step (the
latency of one gloo all-reduce of a decode step's activations among 3 local ranks, times the
collectives a step makes: 2 per layer, 1 for the embedding, 1 all-gather of the logits).

No speed-up is expected on 2 cores: 3 ranks share them, and every collective is a round trip
between processes. The point is correctness at any world size and the cost of the seams.

    python bench/tp.py [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, refuse_if_busy, table  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def engine_rate(world: int, threads: int, streams: int, tokens: int) -> float:
    from kvpilot.server import LLM, SamplingParams

    llm = LLM(num_threads=threads, show_progress=False, tensor_parallel_size=world, kv_cache_memory="128MiB")
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([PROMPT] * streams, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    outs = llm.generate([PROMPT] * streams, params)
    rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    llm.engine.close()
    return rate


def _collective_rank(rank: int, world: int, store: str, rows: int, hidden: int, vocab_part: int, reps: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    x, logits = torch.randn(rows, hidden), torch.randn(rows, vocab_part)
    parts = [torch.empty_like(logits) for _ in range(world)]
    for _ in range(20):
        dist.all_reduce(x)
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x)
    reduce_s = (time.perf_counter() - t) / reps
    t = time.perf_counter()
    for _ in range(reps // 4):
        dist.all_gather(parts, logits)
    gather_s = (time.perf_counter() - t) / (reps // 4)
    if rank == 0:
        out.put((reduce_s, gather_s))
    dist.destroy_process_group()


def collective_latency(world: int, rows: int, hidden: int, vocab_part: int, reps: int = 400) -> tuple[float, float]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    store = str(Path(tempfile.mkdtemp(prefix="kvpilot-bench-tp-")) / "store")
    procs = [ctx.Process(target=_collective_rank, args=(r, world, store, rows, hidden, vocab_part, reps, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return out.get()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    cores = os.cpu_count() or 1
    rows = []
    for world, threads in ((1, cores), (1, 1), (3, 1)):
        for streams in (1, 8):
            rate = engine_rate(world, threads, streams, args.tokens)
            rows.append({"ranks": world, "threads per rank": threads, "streams": streams, "output tok/s": f"{rate:.1f}",
                         "ms per step": f"{1000 * streams / rate:.0f}"})
            print(rows[-1], flush=True)
    layers, hidden, vocab = 30, 576, 49152
    collectives = 2 * layers + 1
    comm = []
    for batch in (1, 8):
        reduce_s, gather_s = collective_latency(3, batch, hidden, vocab // 3)
        comm.append({"decode rows": batch, "all-reduce [rows, 576] µs": f"{reduce_s * 1e6:.0f}", "all-gather logits µs": f"{gather_s * 1e6:.0f}",
                     "per step (61 all-reduces + 1 gather) ms": f"{(collectives * reduce_s + gather_s) * 1000:.1f}"})
        print(comm[-1], flush=True)
    print(f"\nmachine: {machine()}; greedy decode of {args.tokens} tokens after a {len(PROMPT)}-character prompt\n")
    print(table(rows, ["ranks", "threads per rank", "streams", "output tok/s", "ms per step"]))
    print()
    print(table(comm, list(comm[0])))


if __name__ == "__main__":
    main()
