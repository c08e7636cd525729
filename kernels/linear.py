"""Dense projections (y = x @ W.T): oneDNN with weights packed once on CPU, plain torch elsewhere.

Why not just `x @ W.T` on CPU: torch's CPU matmul goes to MKL, which on non-Intel x86 (our AMD EPYC)
takes its AVX2 path; oneDNN dispatches on the CPU's ISA and, fed a weight reordered into its blocked
layout once at load, reaches 2–4× MKL's fp32 FLOP rate at this model's shapes, and more on the
memory-bound single-token steps (bench/RESULTS.md has the micro-benchmark). Same fp32 arithmetic, only
the summation order differs. The fused forms fold the SiLU, the gating product and the residual add
into the matmul's output pass instead of another trip over the activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@dataclass(slots=True)
class LinearWeight:
    """One projection's weight: dense [out, in] (reference / CUDA path) or oneDNN-packed (CPU path)."""
    dense: torch.Tensor | None
    packed: torch.Tensor | None

    @classmethod
    def create(cls, weight: torch.Tensor, use_onednn: bool | None = None) -> LinearWeight:
        if use_onednn is None:
            use_onednn = weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and onednn_available()
        if use_onednn:
            # The packed copy is all the CPU path reads; keeping the dense one too would double the memory.
            return cls(None, torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None))
        return cls(weight.contiguous(), None)


def _pointwise(x: torch.Tensor, w: LinearWeight, attr: str) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w.packed, None, attr, [], "")


def linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    return _pointwise(x, w, "none") if w.packed is not None else F.linear(x, w.dense)


def linear_silu(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    """silu(x @ W.T)"""
    return _pointwise(x, w, "swish") if w.packed is not None else F.silu(F.linear(x, w.dense))


def linear_mul(x: torch.Tensor, w: LinearWeight, other: torch.Tensor) -> torch.Tensor:
    """(x @ W.T) * other"""
    if w.packed is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, w.packed, None, "mul")
    return F.linear(x, w.dense) * other


def linear_add(x: torch.Tensor, w: LinearWeight, residual: torch.Tensor) -> torch.Tensor:
    """(x @ W.T) + residual"""
    if w.packed is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w.packed, None, "add")
    return F.linear(x, w.dense) + residual
