"""Rotary position embedding's per-forward state and its torch formula, shared by the dispatch table
(kernels/ops.py), the Triton kernels and the layers: a module of its own so that none of them imports
another for it."""

from __future__ import annotations

from functools import cached_property

import torch


class Rope:
    """RoPE of one forward pass, made once and passed to every layer: the positions, the model's whole
    cos/sin tables [max_position, d/2] (what the C++ pass reads) and, gathered on first use and then
    shared by all layers, the rows for these positions [T, 1, d/2] in the compute dtype (what the
    reference reads)."""

    def __init__(self, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, dtype: torch.dtype):
        self.positions, self.cos_table, self.sin_table, self.dtype = positions, cos_table, sin_table, dtype

    @cached_property
    def cos(self) -> torch.Tensor:
        return self.cos_table[self.positions][:, None, :].to(self.dtype)

    @cached_property
    def sin(self) -> torch.Tensor:
        return self.sin_table[self.positions][:, None, :].to(self.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] rotated, half-split layout (pairs (i, i + d/2))."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
