"""The LoRA delta in Triton (kernels/lora.py has the layout), one kernel run twice: shrink,
s = x @ A^T[slot] into R columns per row, then expand, y += s @ B^T[slot]. Each row reads its own slot from the device
(-1: the program returns at once), so one launch serves a step mixing any adapters with base rows and
a CUDA graph captures it with the slots as an input. float32 accumulation; y keeps its dtype. Tested
against the reference under TRITON_INTERPRET=1 (tests/test_lora.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.lora import LoRABatch


@triton.jit
def _row_times_slot(x_ptr, w_ptr, slot_ptr, out_ptr, K, N, stride_x, stride_ws, stride_wk, stride_out,
                    ACCUMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, n-block] (+)= x[t, :] @ w[slot[t]][:, n-block] for a row t whose slot is >= 0."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + slot * stride_ws + k[:, None] * stride_wk + n[None, :], mask=(k[:, None] < K) & (n[None, :] < N), other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[:, None], axis=0)
    if ACCUMULATE:
        acc += tl.load(out_ptr + t * stride_out + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)


def lora_add_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> None:
    """kernels.ops' lora_add_: y [T, N] += per row t with slot s >= 0: (x[t] @ a[s]) @ b[s] (a: A^T
    [slots, K, R], b: B^T [slots, R, N]): the same kernel twice, shrink into float32 s, then expand into y."""
    t, k = x.shape
    r, n = a.shape[2], b.shape[2]
    if x.stride(-1) != 1 or y.stride(-1) != 1 or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("the Triton LoRA kernels need rows with unit stride and contiguous adapter slots")
    if t == 0:
        return
    s = torch.empty(t, r, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(min(r, 64)))
    _row_times_slot[(t, triton.cdiv(r, block_r))](x, a, batch.token_slots, s, k, r, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
                                                  ACCUMULATE=False, BLOCK_N=block_r, BLOCK_K=64)
    _row_times_slot[(t, triton.cdiv(n, 64))](s, b, batch.token_slots, y, r, n, s.stride(0), b.stride(0), b.stride(1), y.stride(0),
                                             ACCUMULATE=True, BLOCK_N=64, BLOCK_K=block_r)
