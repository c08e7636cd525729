"""Per-layer elementwise work as Triton kernels, the GPU forms of kernels/csrc/layers_cpu.cpp:
RMSNorm, and RoPE on the fused QKV projection's output with this step's K and V stored into the paged
cache in the same pass (one launch where the references take a chain of small ops). float32 math;
outputs in the input's (and the cache's) dtype; an FP8 cache's bytes through kernels/triton_fp8.py. Tested against the references under
TRITON_INTERPRET=1 (tests/test_triton_layers.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.paged_attention import FP8_KV, NO_SCALES
from kvpilot.kernels.rope import Rope
from kvpilot.kernels.triton_fp8 import fp8_e4m3_bits


@triton.jit
def _rms_norm(x_ptr, w_ptr, y_ptr, N, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    # As transformers: the normalised row is cast to the input's dtype before a weight in that dtype multiplies it
    # (Llama's RMSNorm); a float32 weight (Gemma's 1 + w) multiplies before the one rounding.
    if w_ptr.dtype.element_ty == y_ptr.dtype.element_ty:
        normed = normed.to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    rows = x.reshape(-1, n).contiguous()
    y = torch.empty_like(rows)
    _rms_norm[(rows.shape[0],)](rows, weight.contiguous(), y, n, rows.stride(0), y.stride(0), eps, BLOCK=triton.next_power_of_2(n))
    return y.reshape(x.shape)


@triton.jit
def _cache_value(x, scale, cache_ptr, FP8: tl.constexpr):
    """float32 values as the cache holds them: an FP8 cache's bytes of x / scale, else the cache's dtype."""
    if FP8:
        return fp8_e4m3_bits(x / scale)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rotary_store(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_t, k_scale, v_scale,
                  HEADS: tl.constexpr, KV_HEADS: tl.constexpr, ROT_PAD: tl.constexpr, KV_PAD: tl.constexpr,
                  HALF: tl.constexpr, STORE: tl.constexpr, KV_FP8: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, ROT_PAD)
    i = tl.arange(0, HALF)
    rot = (h < HEADS + KV_HEADS)[:, None]
    row = qkv_ptr + t * stride_t
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * HALF + i)[None, :]
    s = tl.load(sin_ptr + pos * HALF + i)[None, :]
    first = row + h[:, None] * (2 * HALF) + i[None, :]
    x1 = tl.load(first, mask=rot, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=rot, other=0.0).to(tl.float32)
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    tl.store(first, y1.to(qkv_ptr.dtype.element_ty), mask=rot)
    tl.store(first + HALF, y2.to(qkv_ptr.dtype.element_ty), mask=rot)
    if STORE:  # the rotated K heads (as qkv holds them) and the V heads at this token's cache slot
        y1, y2 = y1.to(qkv_ptr.dtype.element_ty).to(tl.float32), y2.to(qkv_ptr.dtype.element_ty).to(tl.float32)
        slot = tl.load(slot_ptr + t)
        kv = h - HEADS
        is_k = ((h >= HEADS) & (h < HEADS + KV_HEADS))[:, None]
        dest = slot * (KV_HEADS * 2 * HALF) + kv[:, None] * (2 * HALF) + i[None, :]
        tl.store(k_cache_ptr + dest, _cache_value(y1, k_scale, k_cache_ptr, KV_FP8), mask=is_k)
        tl.store(k_cache_ptr + dest + HALF, _cache_value(y2, k_scale, k_cache_ptr, KV_FP8), mask=is_k)
        g = tl.arange(0, KV_PAD)
        d = tl.arange(0, 2 * HALF)
        v_ok = (g < KV_HEADS)[:, None]
        v = tl.load(row + (HEADS + KV_HEADS + g[:, None]) * (2 * HALF) + d[None, :], mask=v_ok, other=0.0).to(tl.float32)
        tl.store(v_cache_ptr + slot * (KV_HEADS * 2 * HALF) + g[:, None] * (2 * HALF) + d[None, :],
                 _cache_value(v, v_scale, v_cache_ptr, KV_FP8), mask=v_ok)


def rotary_qkv_(qkv: torch.Tensor, rope: Rope, num_heads: int, num_kv_heads: int, head_dim: int,
                store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, kv_scales: tuple[float, float] = NO_SCALES) -> bool:
    """kernels.ops' rotary_qkv_: the query and key heads of qkv [T, (heads + 2 kv_heads) * d] rotated in
    place (half-split pairs), and with `store` = (k_cache, v_cache, slots) the K and V rows written to
    the cache (an FP8 cache's divided by kv_scales). Returns whether they were."""
    if head_dim & (head_dim - 1) or qkv.stride(-1) != 1 or qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"the Triton RoPE kernel needs contiguous fused QKV rows and a power-of-two head_dim, not {head_dim}")
    if store is not None and not (store[0].is_contiguous() and store[1].is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    k_cache, v_cache, slots = store if store is not None else (qkv, qkv, rope.positions)
    fp8 = k_cache.dtype == FP8_KV
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _rotary_store[(qkv.shape[0],)](qkv, rope.positions.contiguous(), rope.cos_table.float().contiguous(), rope.sin_table.float().contiguous(),
                                   slots.contiguous(), k_cache, v_cache, qkv.stride(0), *kv_scales,
                                   HEADS=num_heads, KV_HEADS=num_kv_heads, ROT_PAD=triton.next_power_of_2(num_heads + num_kv_heads),
                                   KV_PAD=triton.next_power_of_2(num_kv_heads), HALF=head_dim // 2, STORE=store is not None, KV_FP8=fp8)
    return store is not None
