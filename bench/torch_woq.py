"""torch's own weight-only quantized CPU matmuls beside kvpilot's panel kernel, per call, at the bundled
model's shapes (2 threads): what #14 asked to measure before keeping our C++ kernels.

    .venv/bin/python bench/torch_woq.py [--rows 1,16,128] [--threads 2] [--force]

- int8: `torch._weight_int8pack_mm` (int8 weights, one scale per output channel) against our
  `--quantization int8` weights (int8 per 32 input columns, the Q8_0 layout).
- int4: `torch._weight_int4pack_mm_for_cpu` (4-bit weights packed by
  `_convert_weight_to_int4pack_for_cpu`, group 32, scale and zero per group) against our
  `--quantization int4` group 32 (the Q4_1 layout).
torch's kernels get bfloat16 activations (and scales), their fast case here: with float32 ones the int8
kernel took 22x longer (3.8 ms vs 168 µs for the gate shape at M = 16, float16 9.5 ms); ours take
float32.
- oneDNN's weight-only decompression is not reachable from this torch without intel-extension-for-pytorch
  (torch.ops.onednn has only the int8-activation qlinear and fp16 dynamic linear): not measured.
Each figure is the best of 5 rounds (bench/common.best_us); every pair is checked to compute the same
product (relative error of each against x @ dequantized.T).
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

SHAPES = {"qkv": (960, 576), "gate": (1536, 576), "down": (576, 1536), "head": (49152, 576)}
GROUP = 32


def torch_int8(w: torch.Tensor):
    """Per output channel symmetric int8 and torch's kernel on it."""
    scale = w.abs().amax(1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    scale = scale.to(torch.bfloat16)
    return partial(lambda x, q, s: torch._weight_int8pack_mm(x, q, s), q=q, s=scale), q.float() * scale.float()[:, None]


def torch_int4(w: torch.Tensor):
    """Asymmetric int4 per group of 32 and torch's packed kernel on it (w = (q - 8)·scale + zero)."""
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    zero = lo + 8 * scale  # (q - 8)·scale + zero = q·scale + lo
    dense = (q * scale[..., None] + lo[..., None]).reshape(n, k)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(n, k).to(torch.int32), 2)
    scales_and_zeros = torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()  # [k / 32, n, 2]
    return partial(lambda x, p, sz: torch._weight_int4pack_mm_for_cpu(x, p, GROUP, sz), p=packed, sz=scales_and_zeros), dense


def ours(ext, weight):
    qs, d, m = to_panels(weight)
    return partial(ext.gguf_linear_panel, qs=qs, d=d, m=m, kind=LAYOUTS[weight.kind].kernel_kind, n=weight.shape[0],
                   bias=None, epilogue=0, other=None, isa="auto"), weight.dequantize()


def rel_error(y: torch.Tensor, want: torch.Tensor) -> float:
    return ((y.float() - want).norm() / want.norm()).item()


def main() -> None:
    args = per_call_args("1,16,128")
    ext = cpu_extension.require()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=gen) * 0.05
        kernels = {"int8": (torch_int8(w), ours(ext, quantize_int8(w))), "int4": (torch_int4(w), ours(ext, quantize_int4(w, GROUP)))}
        for mode, ((theirs, their_dense), (mine, my_dense)) in kernels.items():
            for m in args.rows:
                x = torch.randn(m, k, generator=gen)
                their_x = x.to(torch.bfloat16)
                errors = (rel_error(theirs(their_x), their_x.float() @ their_dense.T), rel_error(mine(x), x @ my_dense.T))
                if max(errors) > 2e-2:
                    raise SystemExit(f"{name} {mode} M={m}: a kernel disagrees with its own weights (relative errors {errors})")
                calls = max(1, 20_000_000 // (n * k * m) + 1)
                t_theirs, t_mine = best_us(partial(theirs, their_x), calls), best_us(partial(mine, x), calls)
                rows.append({"shape": f"{name} {n}x{k}", "mode": mode, "M": m, "torch µs": f"{t_theirs:.0f}", "kvpilot µs": f"{t_mine:.0f}",
                             "torch / kvpilot": f"{t_theirs / t_mine:.2f}x"})
    print(f"machine: {machine()}, {args.threads} threads, torch {torch.__version__}, kvpilot isa {ext.gguf_linear_isa()}")
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
