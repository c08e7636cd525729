"""The LoRA delta as two Triton kernels (kernels/lora.py has the layout): shrink, s = x @ A^T[slot]
into R columns per row, then expand, y += s @ B^T[slot]. Each row reads its own slot from the device
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
def _shrink(x_ptr, a_ptr, slot_ptr, s_ptr, K, R, stride_x, stride_as, stride_ak, stride_s, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + k[None, :] * stride_ak + r[:, None], mask=(r[:, None] < R) & (k[None, :] < K), other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(s_ptr + t * stride_s + r, acc, mask=r < R)


@triton.jit
def _expand(s_ptr, b_ptr, slot_ptr, y_ptr, N, R, stride_s, stride_bs, stride_br, stride_y, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        s = tl.load(s_ptr + t * stride_s + r, mask=r < R, other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + r[None, :] * stride_br + n[:, None], mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)
        acc += tl.sum(b.to(tl.float32) * s[None, :], axis=1)
    y = tl.load(y_ptr + t * stride_y + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + n, (y + acc).to(y_ptr.dtype.element_ty), mask=n < N)


def lora_add_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> None:
    """kernels.ops' lora_add_: y [T, N] += per row t with slot s >= 0: (x[t] @ a[s]) @ b[s] (a: A^T
    [slots, K, R], b: B^T [slots, R, N])."""
    t, k = x.shape
    r, n = a.shape[2], b.shape[2]
    if x.stride(-1) != 1 or y.stride(-1) != 1 or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("the Triton LoRA kernels need rows with unit stride and contiguous adapter slots")
    if t == 0:
        return
    s = torch.empty(t, r, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(min(r, 64)))
    _shrink[(t, triton.cdiv(r, block_r))](x, a, batch.token_slots, s, k, r, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
                                          BLOCK_R=block_r, BLOCK_K=64)
    _expand[(t, triton.cdiv(n, 64))](s, b, batch.token_slots, y, n, r, s.stride(0), b.stride(0), b.stride(1), y.stride(0),
                                     BLOCK_N=64, BLOCK_R=block_r)
