"""kvpilot's bfloat16 projection kernel (kernels/csrc/bf16_linear_cpu.cpp: AVX512-BF16, and AMX tiles where the CPU
has them) against oneDNN's packed bfloat16 matmul (what the CPU path ran before it, and what vLLM's CPU build runs),
interleaved in one process, at SmolLM2-135M's shapes: a decoder's 30 layers of q/k/v, o, gate, up and down called in
turn (each weight comes from memory, as in a decode step) at 1–256 rows, and each projection alone called back to back
(its weight in the caches: the instruction limit). On a CPU with AMX each of the kernel's two paths is timed at every
row count (its auto choice: the tiles for each whole tile of 16 rows, AVX512-BF16 for the rest).

    .venv/bin/python bench/bf16_linear.py [--threads 2] [--json OUT] [--force]
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
from common import machine, refuse_if_busy, save_results, table  # noqa: E402

from kvpilot.kernels import cpu_extension  # noqa: E402
from kvpilot.kernels.linear import bf16_panels_available, make_linear  # noqa: E402

SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate", 1536, 576), ("up", 1536, 576), ("down", 576, 1536)]  # (out, in)
LAYERS = 30
LAYOUTS = ("onednn", "bf16-panels")


def best_of(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,8,16,32,64,256")
    ap.add_argument("--json")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    if not bf16_panels_available():
        raise SystemExit("this CPU has no AVX512-BF16: kvpilot's bfloat16 kernel does not run here (oneDNN does)")
    torch.set_num_threads(args.threads)
    ext = cpu_extension.require()
    isas = ["avx512-bf16", "amx"] if ext.bf16_linear_isa() == "amx" else ["avx512-bf16"]
    gen = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=gen) * 0.05).bfloat16() for _, n, k in SHAPES] for _ in range(LAYERS)]
    model = {layout: [[make_linear(w, layout=layout) for w in layer] for layer in weights] for layout in LAYOUTS}
    # (contender, layout, how a projection is called): oneDNN's, then the kernel on each path it has here
    contenders = [("oneDNN", "onednn", lambda lin, x: lin(x))]
    contenders += [(f"kvpilot {isa}", "bf16-panels", lambda lin, x, isa=isa: ext.bf16_linear(x, lin.weight, lin.out_features, None, 0, None, isa))
                   for isa in isas]
    names = [name for name, _, _ in contenders]
    rows, figures = [], []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in {k for _, _, k in SHAPES}}
        flop = 2 * m * sum(n * k for _, n, k in SHAPES)
        timed = {}
        for name, layout, call in contenders:  # the whole stack: weights from memory
            def stack(layers=model[layout], xs=xs, call=call):
                for layer in layers:
                    for lin, (_, _, k) in zip(layer, SHAPES):
                        call(lin, xs[k])
            timed[name, "memory"] = best_of(stack, 5) / LAYERS
        for name, layout, call in contenders:  # one layer's projections, each 20 times over: weights in the caches
            def hot(layer=model[layout][0], xs=xs, call=call):
                for lin, (_, _, k) in zip(layer, SHAPES):
                    for _ in range(20):
                        call(lin, xs[k])
            timed[name, "cache"] = best_of(hot, 3) / 20
        for where in ("memory", "cache"):
            gflops = {name: flop / timed[name, where] / 1e9 for name in names}
            figures.append({"rows": m, "weights": where, "gflops": gflops})
            best = max(names[1:], key=gflops.get)
            rows.append({"rows": m, "weights from": where, **{f"{name} GFLOP/s": f"{gflops[name]:.0f}" for name in names},
                         "kvpilot's best / oneDNN": f"{gflops[best] / gflops['oneDNN']:.2f}x ({best.removeprefix('kvpilot ')})"})
    print(machine(), f"{args.threads} threads; one layer's q/k/v, o, gate, up, down of SmolLM2-135M, bfloat16")
    print(table(rows, ["rows", "weights from", *[f"{name} GFLOP/s" for name in names], "kvpilot's best / oneDNN"]))
    if args.json:
        save_results(args.json, threads=args.threads, figures=figures)


if __name__ == "__main__":
    main()
