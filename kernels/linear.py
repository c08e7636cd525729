"""Dense projections (y = x @ W.T): oneDNN with weights packed once on CPU, plain torch elsewhere.

Why not just `x @ W.T` on CPU: torch's CPU matmul goes to MKL, which on non-Intel x86 (our AMD EPYC)
takes its AVX2 path; oneDNN dispatches on the CPU's ISA and, fed a weight reordered into its blocked
layout once at load, reaches 2–4× MKL's fp32 FLOP rate at this model's shapes, and more on the
memory-bound single-token steps (bench/history/ has the micro-benchmark). Same fp32 arithmetic, only
the summation order differs. The fused forms fold the SiLU, the gating product and the residual add
into the matmul's output pass instead of another trip over the activations.
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
from kvpilot.kernels.quantized import GGUFLinear, GGUFWeight


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


@direct_call
class Linear(nn.Module):
    """y = x @ W.T (+ b), with the fused forms the layers use. The weight is a registered buffer (seen
    by .to() and state_dict()): dense [out, in], or oneDNN's packed layout on CPU (then `packed`)."""

    def __init__(self, weight: torch.Tensor, packed: bool, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = packed
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._pointwise(x, "none") if self.packed else F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ W.T + b)"""
        return self._pointwise(x, "swish") if self.packed else F.silu(F.linear(x, self.weight, self.bias))

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x @ W.T + b) * other"""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "mul")
        return F.linear(x, self.weight, self.bias) * other

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """(x @ W.T + b) + residual"""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        if self.bias is None:  # the add in the GEMM's epilogue (beta = 1): no second pass over the output
            return torch.addmm(residual, x, self.weight.t())
        return F.linear(x, self.weight, self.bias) + residual

    def _pointwise(self, x: torch.Tensor, attr: str) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, attr, [], "")


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
                use_onednn: bool | None = None, adapt: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
    """The one factory the model loader calls for every projection: (weight [out, in] — this rank's
    rows or columns under tensor parallelism, or a GGUF-block weight —, bias, shard) -> a Linear.
    Column-parallel projections need nothing here (a rank's rows are a smaller projection); `shard`
    marks a row-parallel one. adapt: wraps this rank's projection (LoRA slots: kernels/lora.py) —
    inside a row-parallel one's all-reduce, which then sums the ranks' deltas too."""
    if shard is not None:
        return RowParallelLinear(make_linear(weight, bias if shard.rank == 0 else None, use_onednn=use_onednn, adapt=adapt), shard.rank, shard.group)
    if adapt is not None:
        return adapt(make_linear(weight, bias, use_onednn=use_onednn))
    if isinstance(weight, GGUFWeight):
        return gguf_linear_class(weight.qs.device)(weight, bias)
    if use_onednn is None:
        use_onednn = weight.device.type == "cpu" and onednn_packs(weight.dtype)
    elif use_onednn and not onednn_packs(weight.dtype):
        raise ValueError(f"oneDNN cannot pack {weight.dtype} weights on this CPU (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    # The packed copy is all the CPU path reads; keeping the dense one too would double the memory.
    w = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None) if use_onednn else weight.contiguous()
    return Linear(w, packed=use_onednn, bias=bias)
