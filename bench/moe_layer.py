"""One mixture-of-experts layer at Qwen3-30B-A3B's shapes (128 experts, top-8, hidden 2048, each expert's inner 768),
random weights: the fused-experts op (kvpilot's C++ kernel: the step's tokens grouped by expert, each expert's
weights read once) against a loop over the experts in torch (transformers' eager MoE: for each expert hit, its
tokens' rows through its three matmuls), at 1, 16 and 256 tokens, with bfloat16 weights and with Q4 blocks (int4 as
Q4_1; the loop then runs kvpilot's GGUF-block linear per expert). The same router output for both; outputs checked
equal before timing.

  .venv/bin/python bench/moe_layer.py [--tokens 1,16,256] [--formats bf16,q4] [--json bench/results/moe-layer.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import refuse_if_busy, save_results, table  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INNER = 128, 8, 2048, 768


def loop_over_experts(x, gate, up, down, weights, ids):
    """transformers' eager experts: a mask per expert, only the experts hit run (gate/up/down: per-expert callables)."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    hit = torch.unique(ids).tolist()
    for e in hit:
        token, slot = torch.where(ids == e)
        rows = x[token]
        h = down[e](F.silu(gate[e](rows)) * up[e](rows))
        out.index_add_(0, token, h.float() * weights[token, slot, None])
    return out.to(x.dtype)


def layer(fmt: str, gen):
    """(Experts for the fused op, the activations' dtype, and per-expert gate / up / down callables for the loop) of one
    layer of random weights: bfloat16 matrices, or int4 blocks (Q4_1's layout) made from them."""
    import torch

    from kvpilot.kernels.fused_moe import ExpertPanels, Experts
    from kvpilot.kernels.quantized import GGUFLinear, quantize_int4

    w13 = (torch.randn(EXPERTS, 2 * INNER, HIDDEN, generator=gen) / 45).to(torch.bfloat16)
    w2 = (torch.randn(EXPERTS, HIDDEN, INNER, generator=gen) / 28).to(torch.bfloat16)
    mats = ([w13[e, :INNER] for e in range(EXPERTS)], [w13[e, INNER:] for e in range(EXPERTS)], [w2[e] for e in range(EXPERTS)])
    if fmt == "bf16":
        matmul = lambda w: (lambda r: r @ w.t())  # noqa: E731
        return Experts(INNER, w13, w2), torch.bfloat16, *([matmul(w) for w in ws] for ws in mats)
    if fmt == "q4":
        blocks = [[quantize_int4(w.float(), 32) for w in ws] for ws in mats]
        panels = tuple(ExpertPanels.of(ws) for ws in blocks)
        return Experts(INNER, panels=panels), torch.float32, *([GGUFLinear(w) for w in ws] for ws in blocks)
    sys.exit(f"unknown format {fmt!r} (bf16, q4)")


def timed(fn, seconds: float = 3.0) -> float:
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or n < 3:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--formats", default="bf16,q4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    ap.add_argument("--force", action="store_true", help="run on a busy machine")
    ap.add_argument("--json", help="write the figures here (bench/results/moe-layer.json)")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)

    import torch

    from kvpilot.kernels import cpu_extension
    from kvpilot.kernels.fused_moe import fused_experts_cpu, route

    torch.set_num_threads(args.threads)
    ext = cpu_extension.require()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for fmt in args.formats.split(","):
        experts, dtype, gate, up, down = layer(fmt, gen)
        for tokens in map(int, args.tokens.split(",")):
            x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
            weights, ids = route(torch.randn(tokens, EXPERTS, generator=gen), TOP_K, renormalize=True)
            fused = partial(fused_experts_cpu, ext, x, experts, weights, ids)
            looped = partial(loop_over_experts, x, gate, up, down, weights, ids)
            a, b = fused().float(), looped().float()
            error = ((a - b).abs().max() / b.abs().max()).item()
            if error > 2e-2:
                sys.exit(f"{fmt} at {tokens} tokens: the fused op and the loop differ (max relative {error:.2e})")
            t_fused, t_loop = timed(fused, args.seconds), timed(looped, args.seconds)
            rows.append({"weights": fmt, "tokens": tokens, "experts hit": len(torch.unique(ids)), "fused ms": round(t_fused * 1e3, 2),
                         "loop ms": round(t_loop * 1e3, 2), "fused / loop": round(t_loop / t_fused, 2)})
            print(table(rows[-1:], list(rows[-1])), flush=True)
    print(table(rows, list(rows[0])))
    if args.json:
        save_results(args.json, shapes={"experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "inner": INNER}, threads=args.threads, rows=rows)


if __name__ == "__main__":
    main()
