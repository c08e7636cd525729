"""Expert parallelism against the inner-dimension split (kvpilot's tensor parallelism) for one mixture-of-experts layer at
Qwen3-30B-A3B's shapes (128 experts, top-8, hidden 2048, each expert's inner 768), over two ranks: two processes on gloo,
one thread each. TP: every rank holds every expert with half its inner dimension and runs the step's tokens through the
fused-experts op. EP: every rank holds half the experts whole and runs the (token, expert) pairs routed to them (gathered
into rows of their own, their outputs added back to their tokens: what an all-to-all dispatch hands a rank). Both sum the
ranks' [tokens, hidden] with one all-reduce, as an engine whose attention is replicated or split by heads does.

Routings: "uniform" (random router logits: every expert about as likely) and "skewed" (each expert's logits offset by a
fixed N(0, 1) draw: hot and cold experts, as trained routers have), each figure over --draws router outputs that the steps
cycle through (one draw is one split of a token's experts: 4:4 or 7:1). Besides the times, the weight bytes each rank reads
in a step (the hit experts' matrices: TP half of every hit expert, EP the whole of its own hit experts), whose max over
the ranks bounds a memory-bound step on any hardware; the two ranks here share one memory bus, so a rank that finishes
early leaves its bandwidth to the other, which softens EP's imbalance against GPUs with a memory each.

  .venv/bin/python bench/moe_parallel.py [--tokens 1,16,256] [--formats bf16,q4] [--repeats 2] [--draws 16] [--json bench/results/moe-parallel.json]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import refuse_if_busy, save_results, table  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INNER = 128, 8, 2048, 768
RANKS = 2


def shares(fmt: str, rank: int):
    """(TP's experts: every expert's inner half `rank`, EP's experts: the experts of share `rank` whole, the activations'
    dtype, the bytes of one expert's three matrices whole) for one layer of the seeded random weights (every rank draws
    the same), bfloat16 or int4 blocks (Q4_1's layout)."""
    import torch

    from kvpilot.kernels.fused_moe import ExpertPanels, Experts
    from kvpilot.kernels.quantized import quantize_int4

    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INNER, HIDDEN, generator=gen) / 45).to(torch.bfloat16)
    w2 = (torch.randn(EXPERTS, HIDDEN, INNER, generator=gen) / 28).to(torch.bfloat16)
    lo, hi = rank * INNER // RANKS, (rank + 1) * INNER // RANKS
    first, end = rank * EXPERTS // RANKS, (rank + 1) * EXPERTS // RANKS
    tp = (w13[:, lo:hi], w13[:, INNER + lo:INNER + hi], w2[:, :, lo:hi])  # gate, up, down
    ep = (w13[first:end, :INNER], w13[first:end, INNER:], w2[first:end])
    if fmt == "bf16":
        make = lambda gate, up, down: Experts(gate.shape[1], torch.cat([gate, up], dim=1).contiguous(), down.contiguous())  # noqa: E731
        return make(*tp), make(*ep), torch.bfloat16, 3 * HIDDEN * INNER * 2
    if fmt == "q4":
        def make(gate, up, down):
            return Experts(gate.shape[1], panels=tuple(ExpertPanels.of([quantize_int4(m.float(), 32) for m in ws]) for ws in (gate, up, down)))
        q4_bytes = 3 * HIDDEN * INNER // 32 * 20  # Q4_1: 32 weights in 16 bytes of codes and two float16s
        return make(*tp), make(*ep), torch.float32, q4_bytes
    sys.exit(f"unknown format {fmt!r} (bf16, q4)")


def routing(kind: str, tokens: int, gen):
    import torch

    from kvpilot.kernels.fused_moe import route

    logits = torch.randn(tokens, EXPERTS, generator=gen)
    if kind == "skewed":
        logits = logits + torch.randn(EXPERTS, generator=torch.Generator().manual_seed(7))
    return route(logits, TOP_K, renormalize=True)


def timed_steps(step, seconds: float) -> tuple[list[float], list[float]]:
    """(step seconds, compute seconds) of as many steps as fill `seconds` on rank 0 (every rank runs as many): each its
    fused experts, then the all-reduce of the outputs, started together."""
    import torch
    import torch.distributed as dist

    first = time.perf_counter()
    step()
    count = torch.tensor([max(5, int(seconds / max(time.perf_counter() - first, 1e-4)))])
    dist.broadcast(count, 0)
    step_s, compute_s = [], []
    for _ in range(int(count)):
        dist.barrier()
        start = time.perf_counter()
        out = step()
        computed = time.perf_counter()
        dist.all_reduce(out)
        step_s.append(time.perf_counter() - start)
        compute_s.append(computed - start)
    return step_s, compute_s


def tp_step(ext, x, experts, weights, ids):
    from kvpilot.kernels.fused_moe import fused_experts_cpu

    return fused_experts_cpu(ext, x, experts, weights, ids)


def ep_step(ext, x, experts, weights, ids, token, slot, first_expert):
    """The pairs routed to this rank's experts as rows of their own, their outputs added back to their tokens."""
    import torch

    from kvpilot.kernels.fused_moe import fused_experts_cpu

    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float32)
    if len(token):
        y = fused_experts_cpu(ext, x[token], experts, weights[token, slot, None], (ids[token, slot] - first_expert)[:, None])
        out.index_add_(0, token, y.float())
    return out.to(x.dtype)


def cycling(steps: list):
    """One step per call, each in turn: every draw of the routing measured alike (every rank calls them in the same order)."""
    turn = itertools.cycle(steps)
    return lambda: next(turn)()


def measure(ext, rank: int, fmt: str, args) -> list[dict]:
    """This format's rows: each routing and token count over args.draws draws of the router's output (the steps cycle
    through them), TP and EP interleaved args.repeats times (pooled medians)."""
    import torch
    import torch.distributed as dist

    tp_experts, ep_experts, dtype, expert_bytes = shares(fmt, rank)
    per_rank, rows = EXPERTS // RANKS, []
    for kind in args.routings.split(","):
        for tokens in map(int, args.tokens.split(",")):
            gen = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
            draws = [routing(kind, tokens, gen) for _ in range(args.draws)]
            tp, ep, read = [], [], {"TP": [], "EP": []}
            for weights, ids in draws:
                mine = (ids // per_rank == rank).nonzero()
                tp.append(partial(tp_step, ext, x, tp_experts, weights, ids))
                ep.append(partial(ep_step, ext, x, ep_experts, weights, ids, mine[:, 0], mine[:, 1], rank * per_rank))
                hit = torch.unique(ids)
                read["TP"].append(len(hit) * expert_bytes // RANKS)  # half of every hit expert
                read["EP"].append(len(hit[hit // per_rank == rank]) * expert_bytes)  # its own hit experts whole
            for tp_draw, ep_draw in list(zip(tp, ep))[:2]:
                sums = [step().float() for step in (tp_draw, ep_draw)]
                for out in sums:
                    dist.all_reduce(out)
                error = ((sums[0] - sums[1]).abs().max() / sums[0].abs().max()).item()
                if error > 2e-2:
                    sys.exit(f"{fmt} {kind} at {tokens} tokens: TP and EP sum to different outputs (max relative {error:.2e})")
            steps = {"TP": cycling(tp), "EP": cycling(ep)}
            times = {split: ([], []) for split in steps}
            for _ in range(args.repeats):
                for split, step in steps.items():
                    for pooled, got in zip(times[split], timed_steps(step, args.seconds)):
                        pooled.extend(got)
            for split, (step_s, compute_s) in times.items():
                gathered = [None] * RANKS
                dist.all_gather_object(gathered, (statistics.median(compute_s), read[split]))
                per_draw = list(zip(*(r for _, r in gathered)))  # each draw's bytes on each rank
                busiest = [max(d) / (sum(d) / RANKS) for d in per_draw]
                rows.append({"weights": fmt, "routing": kind, "tokens": tokens, "split": split,
                             "step ms": round(statistics.median(step_s) * 1e3, 2),
                             "compute ms per rank": " / ".join(f"{c * 1e3:.2f}" for c, _ in gathered),
                             "MB read per rank (mean)": " / ".join(f"{statistics.mean(r) / 1e6:.0f}" for _, r in gathered),
                             "busiest / mean bytes": f"{statistics.mean(busiest):.2f} ({min(busiest):.2f}-{max(busiest):.2f})"})
            if rank == 0:
                print(table(rows[-2:], list(rows[-1])), flush=True)
    return rows


def rank_main(rank: int, args, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from kvpilot.kernels import cpu_extension

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    ext = cpu_extension.require()
    rows = [row for fmt in args.formats.split(",") for row in measure(ext, rank, fmt, args)]
    if rank == 0:
        results.extend(rows)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--formats", default="bf16,q4")
    ap.add_argument("--routings", default="uniform,skewed")
    ap.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    ap.add_argument("--repeats", type=int, default=2, help="TP and EP measured in turn this many times (pooled medians)")
    ap.add_argument("--draws", type=int, default=16, help="router outputs per figure, the steps cycling through them")
    ap.add_argument("--force", action="store_true", help="run on a busy machine")
    ap.add_argument("--json", help="write the figures here (bench/results/moe-parallel.json)")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)

    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().list()
    mp.spawn(rank_main, args=(args, port, results), nprocs=RANKS, join=True)
    rows = list(results)
    print(table(rows, list(rows[0])))
    if args.json:
        save_results(args.json, shapes={"experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "inner": INNER}, ranks=RANKS,
                     threads_per_rank=1, repeats=args.repeats, draws=args.draws, rows=rows)


if __name__ == "__main__":
    main()
