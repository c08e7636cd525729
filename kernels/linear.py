"""Dense projections (y = x @ W.T): on CPU from weights laid out once at load, plain torch elsewhere.

Why not just `x @ W.T` on CPU: torch's CPU matmul goes to MKL, which on non-Intel x86 (our AMD EPYC)
takes its AVX2 path; oneDNN dispatches on the CPU's ISA and, fed a weight reordered into its blocked
layout once at load, reaches 2–4× MKL's fp32 FLOP rate at this model's shapes, and more on the
memory-bound single-token steps (bench/history/ has the micro-benchmark). Same fp32 arithmetic, only
the summation order differs. bfloat16 weights on a CPU with AVX512-BF16 go to kvpilot's own kernel
instead (kernels/csrc/bf16_linear_cpu.cpp: 1.29× oneDNN at a decode step's 16 rows with the weights
coming from memory, 1.42–1.61× at 1–8, level at 256; bench/bf16_linear.py), on AMX tiles for a
prefill's rows where the CPU has them. The fused forms fold the
SiLU, the gating product and the residual add into the matmul's output pass instead of another trip
over the activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels import cpu_extension
from kvpilot.kernels.direct_call import direct_call
from kvpilot.kernels.ops import triton_kernels
from kvpilot.kernels.quantized import GGUFLinear, GGUFWeight, env_choice


def gguf_linear_class(device: torch.device) -> type[nn.Module]:
    """The GGUF-block projection for weights on `device`: the C++ kernels on CPU, Triton on CUDA (or
    anywhere when forced; KVPILOT_KERNELS=reference leaves projections to their device's kernels)."""
    if device.type == "cuda" or triton_kernels(device):
        from kvpilot.kernels.triton_gguf import TritonGGUFLinear

        return TritonGGUFLinear
    if device.type == "cpu":
        return GGUFLinear
    raise NotImplementedError(f"GGUF-block weights have no kernel on {device.type}")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of this dtype on this CPU: float32 wherever it is available;
    bfloat16 only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT — elsewhere (AVX2-only CPUs, e.g. many
    AMD EPYC VMs) its reorder refuses, and the dense path runs."""
    if not onednn_available():
        return False
    if dtype == torch.float32:
        return True
    flags = cpu_extension._cpu_flags()
    return dtype == torch.bfloat16 and ({"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags)


BF16_PANEL_COLS = 32  # output columns of one panel of kernels/csrc/bf16_linear_cpu.cpp
# The bfloat16 kernel's path: "auto", AMX tiles for every whole tile of 16 rows where the CPU has them (and K is whole tiles
# of 32), AVX512-BF16 for the rest. Naming one pins it: "avx512-bf16" (what a CPU without AMX runs: benchmarks), "amx".
BF16_ISA_ENV = "KVPILOT_BF16_ISA"
BF16_ISAS = ("auto", "amx", "avx512-bf16")


def bf16_isa() -> str:
    return env_choice(BF16_ISA_ENV, BF16_ISAS)


def bf16_panels_available() -> bool:
    """Whether this CPU runs kvpilot's bfloat16 kernel (AVX512-BF16, and the C++ kernels built)."""
    ext = cpu_extension.load()
    return ext is not None and ext.bf16_linear_supported()


def bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bfloat16 (K even) as the kernel reads it: [ceil(N / 32), K / 2, 32, 2], each panel of 32
    output rows holding K in pairs (zeros past N)."""
    n, k = weight.shape
    panels = -(-n // BF16_PANEL_COLS)
    padded = torch.zeros(panels * BF16_PANEL_COLS, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight
    return padded.view(panels, BF16_PANEL_COLS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


LAYOUTS = ("dense", "onednn", "bf16-panels")


@direct_call
class Linear(nn.Module):
    """y = x @ W.T (+ b), with the fused forms the layers use. The weight is a registered buffer (seen
    by .to() and state_dict()) in one of LAYOUTS: dense [out, in]; oneDNN's packed layout (CPU); or
    bf16_panels' (CPU with AVX512-BF16; its bias kept in float32, the kernel's epilogue adds it)."""

    def __init__(self, weight: torch.Tensor, layout: str, bias: torch.Tensor | None = None, out_features: int | None = None):
        super().__init__()
        if layout == "bf16-panels" and out_features is None:
            raise ValueError("a bf16-panels weight holds whole panels: out_features says how many of its rows are the projection's")
        self.layout = layout
        self.isa = bf16_isa() if layout == "bf16-panels" else None
        if self.isa == "amx" and (cpu_extension.load().bf16_linear_isa() != "amx" or weight.shape[1] * 2 % 32):  # (refused at load, not in a step)
            raise ValueError(f"{BF16_ISA_ENV}=amx: this CPU has no AMX-BF16 tiles, or the projection's K ({weight.shape[1] * 2}) is not whole tiles of 32")
        self.out_features = out_features if out_features is not None else weight.shape[0]
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "bf16-panels":
            return self._panels(x, 0)
        return self._pointwise(x, "none") if self.layout == "onednn" else F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ W.T + b)"""
        if self.layout == "bf16-panels":
            return self._panels(x, 1)
        return self._pointwise(x, "swish") if self.layout == "onednn" else F.silu(F.linear(x, self.weight, self.bias))

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x @ W.T + b) * other"""
        if self.layout == "bf16-panels":
            return self._panels(x, 2, other)
        if self.layout == "onednn":
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "mul")
        return F.linear(x, self.weight, self.bias) * other

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """(x @ W.T + b) + residual"""
        if self.layout == "bf16-panels":
            return self._panels(x, 3, residual)
        if self.layout == "onednn":
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        if self.bias is None:  # the add in the GEMM's epilogue (beta = 1): no second pass over the output
            return torch.addmm(residual, x, self.weight.t())
        return F.linear(x, self.weight, self.bias) + residual

    def _pointwise(self, x: torch.Tensor, attr: str) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, attr, [], "")

    def _panels(self, x: torch.Tensor, epilogue: int, other: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if other is not None:
            other = other.reshape(-1, self.out_features)
            if other.stride(-1) != 1:
                other = other.contiguous()
        y = cpu_extension.load().bf16_linear(rows, self.weight, self.out_features, self.bias, epilogue, other, self.isa)
        return y.reshape(*lead, self.out_features)


@dataclass(frozen=True, slots=True)
class RowParallel:
    """Tensor parallelism: this rank holds a slice of the weight's input columns (`make_linear` gets
    that slice); the outputs of all ranks are summed (over `group`: a pipeline stage's ranks; None: all)."""

    rank: int
    group: Any = None


@direct_call
class RowParallelLinear(nn.Module):
    """One rank's slice of a row-parallel projection (any kind: dense, oneDNN-packed, GGUF blocks): its
    partial product, summed over the ranks by one all-reduce. The bias and the fused residual add ride
    on rank 0's part only (`local` is built with the bias on rank 0 alone), so that the sum counts them once."""

    def __init__(self, local: nn.Module, rank: int, group=None):
        super().__init__()
        self.local, self.rank, self.group = local, rank, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(self.local(x), self.group)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return _all_reduce(self.local.add(x, residual) if self.rank == 0 else self.local(x), self.group)


def _all_reduce(t: torch.Tensor, group=None) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t, group=group)
    return t


def make_linear(weight: torch.Tensor | GGUFWeight, bias: torch.Tensor | None = None, shard: RowParallel | None = None,
                layout: str | None = None, adapt: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
    """The one factory the model loader calls for every projection: (weight [out, in] — this rank's
    rows or columns under tensor parallelism, or a GGUF-block weight —, bias, shard) -> a Linear.
    Column-parallel projections need nothing here (a rank's rows are a smaller projection); `shard`
    marks a row-parallel one. adapt: wraps this rank's projection (LoRA slots: kernels/lora.py) —
    inside a row-parallel one's all-reduce, which then sums the ranks' deltas too. layout: one of
    LAYOUTS, None for the device's and dtype's best (default_layout)."""
    if shard is not None:
        return RowParallelLinear(make_linear(weight, bias if shard.rank == 0 else None, layout=layout, adapt=adapt), shard.rank, shard.group)
    if adapt is not None:
        return adapt(make_linear(weight, bias, layout=layout))
    if isinstance(weight, GGUFWeight):
        return gguf_linear_class(weight.qs.device)(weight, bias)
    layout = layout or default_layout(weight)
    if layout == "onednn" and not onednn_packs(weight.dtype):
        raise ValueError(f"oneDNN cannot pack {weight.dtype} weights on this CPU (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    if layout == "bf16-panels" and not _panels_fit(weight):
        raise ValueError("the bf16-panels layout needs bfloat16 CPU weights with an even number of input columns and a CPU with AVX512-BF16")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    # The laid-out copy is all the CPU path reads; keeping the dense one too would double the memory.
    if layout == "onednn":
        return Linear(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None), "onednn", bias=bias)
    if layout == "bf16-panels":
        return Linear(bf16_panels(weight), "bf16-panels", bias=None if bias is None else bias.float(), out_features=weight.shape[0])
    return Linear(weight.contiguous(), "dense", bias=bias)


def default_layout(weight: torch.Tensor) -> str:
    """bf16-panels for bfloat16 on a CPU with AVX512-BF16, oneDNN's packing where it packs the dtype on
    CPU, dense elsewhere."""
    if weight.device.type != "cpu":
        return "dense"
    if _panels_fit(weight):
        return "bf16-panels"
    return "onednn" if onednn_packs(weight.dtype) else "dense"


def _panels_fit(weight: torch.Tensor) -> bool:
    """Whether kvpilot's bfloat16 kernel can take this weight: bfloat16 on CPU, K in whole pairs, the CPU's AVX512-BF16."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and bf16_panels_available()
