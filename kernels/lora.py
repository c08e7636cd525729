"""LoRA adapters on the projections, many in one batch (Punica's and S-LoRA's approach).

Every adapted projection keeps a stack of adapter *slots*, stored transposed so that both products
read contiguous rows: A^T [slots, in, R] and B^T [slots, R, out] (R = max rank × the projection's
parts: 3 for the fused QKV, whose q, k and v adapters sit in a block-diagonal B), the adapter's scale
folded into B, unused entries zero. A step's rows each name a slot (-1: the base model alone), and the
delta y += (x @ A^T[slot]) @ B^T[slot] is added per row — shrink to R columns, expand back — over any base weights (dense, oneDNN-packed, GGUF blocks, int8,
int4: QLoRA-style serving). A step with no adapter row runs the base projection's fused forms
untouched.

Kernels (kernels/ops.py picks one per device, as every op): CPU adds the delta per run of
consecutive rows sharing a slot (the input builder groups a step's rows by slot), two small GEMMs a
run; Triton (kernels/triton_lora.py) reads each row's slot on the device, so a CUDA graph captures
a decode step with the slots as an input, not one graph per adapter; the reference masks rows slot by
slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvpilot.kernels.direct_call import direct_call


@dataclass(slots=True)
class LoRABatch:
    """Which adapter slot each row of a step uses."""

    token_slots: torch.Tensor                 # [T] long, on the device: each row's slot, -1 for none
    runs: list[tuple[int, int, int]] | None   # host: (slot, first row, end row) of each run of rows with one slot (None: unknown on the host)


class LoRAContext:
    """The step's LoRABatch, shared by every adapted projection of one model (the worker sets it
    around a forward; None: no row of the step has an adapter)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


def lora_add_runs_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> None:
    """y[rows] += (x[rows] @ a[s]) @ b[s] for each host-known run of rows sharing slot s (a: A^T
    [slots, in, R], b: B^T [slots, R, out]; contiguous operands: 4x faster here than transposed views
    at one row)."""
    if batch.runs is None:
        lora_add_ref_(y, x, a, b, batch)
        return
    for slot, start, end in batch.runs:
        y[start:end].addmm_(x[start:end] @ a[slot], b[slot])


def lora_add_ref_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> None:
    """The reference: each slot's rows by a mask (reads the slots on the host)."""
    slots = batch.token_slots
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        y.index_add_(0, rows, (x[rows] @ a[slot]) @ b[slot])


@dataclass(frozen=True, slots=True)
class LoRAShape:
    """What a projection's slots hold: its output as `parts` (q, k, v of a fused QKV projection; one
    part otherwise), and which rows of each part's full output and which of the full input's columns
    this rank computes (all of them without tensor parallelism; a column-parallel projection has a
    share of each part's rows, a row-parallel one a share of the input columns, its deltas summed by
    the base's all-reduce)."""

    in_range: tuple[int, int]
    part_ranges: tuple[tuple[int, int], ...]
    max_rank: int

    @property
    def rows(self) -> int:
        return sum(end - start for start, end in self.part_ranges)


@direct_call
class LoRALinear(nn.Module):
    """A projection with adapter slots: the base projection (any kind), plus the delta of each row's
    adapter. Same interface as kernels.linear.Linear (forward, silu, mul, add)."""

    def __init__(self, base: nn.Module, shape: LoRAShape, max_loras: int, context: LoRAContext, add_: Callable[..., None],
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base, self.shape, self.context, self.add_ = base, shape, context, add_
        parts, r = len(shape.part_ranges), shape.max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, shape.in_range[1] - shape.in_range[0], parts * r, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(max_loras, parts * r, shape.rows, dtype=dtype, device=device))

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter into `slot`: per part, its full (A [rank, in], B [out, rank] with its scale
        folded in), of which this rank takes its share, or None where the adapter leaves the part alone."""
        r = self.shape.max_rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        row = 0
        c0, c1 = self.shape.in_range
        for i, ((r0, r1), weights) in enumerate(zip(self.shape.part_ranges, parts)):
            if weights is not None:
                a, b = weights
                rank = a.shape[0]
                self.lora_a[slot, :, i * r:i * r + rank].copy_(a[:, c0:c1].t())
                self.lora_b[slot, i * r:i * r + rank, row:row + r1 - r0].copy_(b[r0:r1].t())
            row += r1 - r0

    def _delta(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.add_(y, x, self.lora_a, self.lora_b, self.context.batch)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return y if self.context.batch is None else self._delta(y, x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        if self.context.batch is None:
            return self.base.silu(x)
        return torch.nn.functional.silu(self._delta(self.base(x), x))

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if self.context.batch is None:
            return self.base.mul(x, other)
        return self._delta(self.base(x), x) * other

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        y = self.base.add(x, residual)
        return y if self.context.batch is None else self._delta(y, x)
