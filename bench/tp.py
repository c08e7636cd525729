"""Tensor and pipeline parallelism on this machine, SmolLM2-135M, greedy decode, one thread per rank (gloo).

Tensor parallelism: 1 rank vs 3 ranks, 1 and 8 streams, and what the communication costs per step (the
latency of one gloo all-reduce of a decode step's activations among 3 local ranks, times the
collectives a step makes: 2 per layer, 1 for the embedding, 1 all-gather of the logits). No speed-up
is expected on 2 cores: 3 ranks share them, and every collective is a round trip between processes.

Pipeline parallelism: 1 rank vs 2 stages (two processes on the two cores) at 1, 8 and 32 streams,
each stage's idle share (1 - its compute seconds / the run's wall time), and a model of a multi-node
cluster computed from the measured per-stage compute and hand-off times (a model with its
assumptions, printed: not a measurement).

    python bench/tp.py [--tokens 64] [--only tp|pp] [--pp-partition 19 11] [--json PATH]
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


def engine_run(world: int, threads: int, streams: int, tokens: int, stages: int = 1, partition: list[int] | None = None) -> tuple[float, float, list[dict]]:
    """(output tok/s, wall seconds, each rank's StageTime over the measured run: steps and compute seconds)."""
    from kvpilot.server import LLM, SamplingParams

    llm = LLM(num_threads=threads, show_progress=False, tensor_parallel_size=world, pipeline_parallel_size=stages, kv_cache_memory="128MiB",
              pipeline_layer_partition=partition)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([PROMPT] * streams, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    before = llm.engine.describe_ranks()
    t = time.perf_counter()
    outs = llm.generate([PROMPT] * streams, params)
    wall = time.perf_counter() - t
    after = llm.engine.describe_ranks()
    llm.engine.close()
    ranks = [{"steps": a["stage_steps"] - b["stage_steps"], "seconds": a["stage_seconds"] - b["stage_seconds"]} for a, b in zip(after, before)]
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall, wall, ranks


def engine_rate(world: int, threads: int, streams: int, tokens: int) -> float:
    return engine_run(world, threads, streams, tokens)[0]


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


def _hand_off_rank(rank: int, store: str, rows: int, hidden: int, reps: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    x = torch.randn(rows, hidden)
    for i in range(20 + reps):
        if i == 20:
            t = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
    if rank == 0:
        out.put((time.perf_counter() - t) / reps / 2)  # one way
    dist.destroy_process_group()


def hand_off_latency(rows: int, hidden: int, reps: int = 200) -> float:
    """Seconds one stage's hidden states [rows, hidden] (float32) take to reach the next stage's process here (gloo, one way)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    store = str(Path(tempfile.mkdtemp(prefix="kvpilot-bench-pp-")) / "store")
    procs = [ctx.Process(target=_hand_off_rank, args=(r, store, rows, hidden, reps, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return out.get()


# A multi-node cluster, as the model assumes it: each stage on its own node, the hand-off over the network.
LINKS = {"25 Gb/s Ethernet, 30 µs": (25e9 / 8, 30e-6), "200 Gb/s InfiniBand, 5 µs": (200e9 / 8, 5e-6)}


def pipeline_rows(tokens: int, partition: list[int] | None, hidden: int = 576) -> tuple[list[dict], list[dict], list[str]]:
    """PP = 2 vs one rank at 1, 8 and 32 streams; the stages' idle shares; the multi-node model."""
    measured, model = [], []
    for streams in (1, 8, 32):
        one, _, _ = engine_run(1, 1, streams, tokens)
        rate, wall, ranks = engine_run(1, 1, streams, tokens, stages=2, partition=partition)
        # Rows per step under PP: the streams over the stages in flight (each step about an equal share).
        rows = -(-streams // 2)
        compute = [r["seconds"] / max(r["steps"], 1) for r in ranks]
        local = hand_off_latency(rows, hidden)
        measured.append({"streams": streams, "1 rank tok/s": f"{one:.1f}", "PP=2 tok/s": f"{rate:.1f}", "PP=2 / 1 rank": f"{rate / one:.2f}",
                         "stage 0 idle": f"{1 - ranks[0]['seconds'] / wall:.0%}", "stage 1 idle": f"{1 - ranks[1]['seconds'] / wall:.0%}",
                         "stage ms/step (0, 1)": f"{compute[0] * 1000:.1f}, {compute[1] * 1000:.1f}", "hand-off µs": f"{local * 1e6:.0f}"})
        print(measured[-1], flush=True)
        # The model: with as many steps in flight as stages (steady state, enough streams), a step leaves the
        # pipeline every max(stage compute + hand-off); one stream keeps one step in flight: the stages in turn.
        for link, (bandwidth, latency) in {"this machine (gloo, measured)": (None, local), **LINKS}.items():
            hand = local if bandwidth is None else latency + rows * hidden * 2 / bandwidth  # bfloat16 hidden states on a GPU cluster
            rate = rows / (max(compute) + hand) if streams > 1 else 1 / (sum(compute) + 2 * hand)  # (one stream: out and the logits back)
            model.append({"streams": streams, "link": link, "modelled tok/s": f"{rate:.1f}"})
    assumptions = ["each stage on its own node, computing its step as fast as measured here (stage ms/step)",
                   "a step leaves the pipeline every max(stage compute + hand-off) when as many steps as stages are in flight "
                   "(enough streams), else every sum(stage compute) + the hand-offs",
                   "hand-off: the link's latency + the step's hidden states (rows x 576, bfloat16) over its bandwidth; the logits' "
                   "return to rank 0 and rank 0's scheduling and sampling hidden behind the other stages"]
    return measured, model, assumptions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--only", choices=["tp", "pp"])
    ap.add_argument("--pp-partition", type=int, nargs=2, metavar=("FIRST", "SECOND"), help="the stages' layers (default: 15 15)")
    ap.add_argument("--json", help="also write the rows here (bench/results/…)")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    if args.only != "tp":
        measured, model, assumptions = pipeline_rows(args.tokens, args.pp_partition)
        print(f"\nmachine: {machine()}; greedy decode of {args.tokens} tokens after a {len(PROMPT)}-character prompt\n")
        print(table(measured, list(measured[0])))
        print()
        print(table(model, list(model[0])))
        print("\nmodel assumptions:\n- " + "\n- ".join(assumptions))
        if args.json:
            from common import save_results

            save_results(args.json, results=measured, model=model, assumptions=assumptions)
        if args.only == "pp":
            return
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
