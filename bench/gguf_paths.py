"""The GGUF panel kernel's instruction-set paths side by side, per call, at the bundled model's shapes
(2 threads): AMX (both operands as bfloat16 pairs on the tile unit, from gguf_amx_min_rows rows) against
AVX512-VNNI (16-bit activation codes) and plain AVX-512 floats — the paths this CPU has.

    .venv/bin/python bench/gguf_paths.py [--rows 1,16,32,128,512] [--threads 2] [--force]

Weights: random, quantized to Q4_1 (the bundled model's projections) or Q8_0 (its tied head). Each
figure is the best of 5 rounds (bench/common.best_us).
"""

from __future__ import annotations

import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(__file__))

from kvpilot.server.threads import OPENMP_ENV  # noqa: E402

os.environ.update({k: os.environ.get(k, v) for k, v in OPENMP_ENV.items()})

import torch  # noqa: E402
from common import best_us, machine, per_call_args, table  # noqa: E402

from kvpilot.kernels import cpu_extension  # noqa: E402
from kvpilot.kernels.quantized import LAYOUTS, quantize_int4, quantize_int8, to_panels  # noqa: E402

# name -> (out, in, kind): the bundled model's fused QKV, gate (as up), down projections and tied head.
SHAPES = {"qkv": (960, 576, "Q4_1"), "gate": (1536, 576, "Q4_1"), "down": (576, 1536, "Q4_1"), "head": (49152, 576, "Q8_0")}


def main() -> None:
    args = per_call_args("1,16,32,128,512")
    ext = cpu_extension.require()
    every = ["amx", "avx512-vnni", "avx512"]
    paths = every[every.index(ext.gguf_linear_isa()):] if ext.gguf_linear_isa() in every else []
    if not paths:
        raise SystemExit(f"this CPU's GGUF path is {ext.gguf_linear_isa()}: nothing to compare")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (n, k, kind) in SHAPES.items():
        w = torch.randn(n, k, generator=gen) * 0.05
        weight = quantize_int4(w, 32) if kind == "Q4_1" else quantize_int8(w)
        qs, d, m = to_panels(weight)
        for M in args.rows:
            if name == "head" and M > 32:  # the head sees one row per sequence
                continue
            x = torch.randn(M, k, generator=gen)
            calls = max(1, 20_000_000 // (n * k * M) + 1)
            operands = (x, qs, d, m, LAYOUTS[kind].kernel_kind, n, None, 0, None)
            us = {p: best_us(partial(ext.gguf_linear_panel, *operands, p), calls) for p in paths}
            row = {"shape": f"{name} {n}x{k} {kind}", "M": M, **{f"{p} µs": f"{us[p]:.0f}" for p in paths}}
            if "amx" in us:
                row["vnni / amx"] = f"{us['avx512-vnni'] / us['amx']:.2f}x"
            rows.append(row)
    print(f"machine: {machine()}, {args.threads} threads; AMX from {ext.gguf_amx_min_rows} rows")
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
