"""The kernel dispatch layer: every op the model calls, each with a torch reference and per-device
implementations, chosen here and nowhere else.

`ops_for(device)` resolves the table once, when the model is built; layers keep the `Ops` they were
given and call its fields by name (they never look at the device or load an extension themselves).
CPU: the C++ kernels of kernels/csrc (each falls back to the reference for dtypes it does not
cover). CUDA: the Triton kernels (RMSNorm, RoPE with the K/V store, attention for a whole mixed step;
GGUF-block projections in make_linear; a mixture of experts' fused experts). KVPILOT_KERNELS overrides the choice: `triton` runs the Triton
kernels anywhere — on CPU tensors too, under TRITON_INTERPRET=1, which is how CI runs them end to end
— and `reference` the torch references of this table anywhere (comparisons, debugging; projections keep
their device's kernels).
Projections are made by `kernels.linear.make_linear`, which picks their weight format the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from kvpilot.kernels import cpu_extension
from kvpilot.kernels.fused_moe import fused_experts_cpu, fused_experts_reference
from kvpilot.kernels.lora import lora_add_ref_, lora_add_runs_
from kvpilot.kernels.paged_attention import FP8_KV, NO_SCALES, decode_attention_grouped, paged_attention
from kvpilot.kernels.rope import Rope, apply_rope

# --- torch references -----------------------------------------------------------------------------

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, normalised in float32 as transformers does: a weight in x's dtype multiplies the
    normalised row rounded to x's dtype (Llama's RMSNorm); a float32 weight with a half x multiplies before the
    one rounding (Gemma's, whose weight 1 + w stays float32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # bit-identical to the formula below
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (xf * weight).to(dtype)
    return weight * xf.to(dtype)


def rotary_qkv_ref_(qkv: torch.Tensor, rope: Rope, num_heads: int, num_kv_heads: int, head_dim: int,
                    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, kv_scales: tuple[float, float] = NO_SCALES) -> bool:
    """Rotate, in place, the query and key heads of a fused QKV output [T, (heads + 2 kv_heads) * d].
    Returns whether the K/V rows were also stored in the cache (never here: the caller writes them)."""
    rot = num_heads + num_kv_heads
    x = qkv[:, :rot * head_dim].view(qkv.shape[0], rot, head_dim)
    x.copy_(apply_rope(x, rope.cos, rope.sin))
    return False


# --- CPU: the C++ kernels -------------------------------------------------------------------------

def _cpu_ops(ext) -> Ops:
    def rms_norm(x, weight, eps):
        if x.dtype in (torch.float32, torch.bfloat16) and weight.dtype in (x.dtype, torch.float32):  # one C++ pass instead of ~8 small ops
            return ext.rms_norm(x, weight, eps)
        return rms_norm_ref(x, weight, eps)

    def rotary_qkv_(qkv, rope, num_heads, num_kv_heads, head_dim, store=None, kv_scales=NO_SCALES):
        # (bfloat16 rows: with cos/sin in bfloat16 too, as the reference then rounds them, and head_dim <= 512)
        if (qkv.dtype not in (torch.float32, torch.bfloat16) or rope.cos_table.dtype != torch.float32 or rope.dtype != qkv.dtype
                or (qkv.dtype == torch.bfloat16 and head_dim > 512)):
            return rotary_qkv_ref_(qkv, rope, num_heads, num_kv_heads, head_dim, store)
        # rotate and write K/V to the cache in one pass (bfloat16 rows: into a bfloat16 cache only)
        stores = (torch.float32, torch.bfloat16, FP8_KV) if qkv.dtype == torch.float32 else (torch.bfloat16,)
        if store is not None and store[0].dtype in stores:
            ext.rotary_store_kv(qkv, rope.positions, rope.cos_table, rope.sin_table, num_heads, num_kv_heads, head_dim, *store, *kv_scales)
            return True
        ext.rotary_inplace(qkv, rope.positions, rope.cos_table, rope.sin_table, num_heads + num_kv_heads, head_dim)
        return False

    def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, kv_scales=NO_SCALES, window=0):
        if k_cache.dtype == FP8_KV and q.dtype != torch.float32:  # the C++ kernel reads an FP8 cache for float32 queries
            return decode_attention_grouped(q, k_cache, v_cache, block_tables, context_lens, scale, kv_scales, window)
        return ext.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *kv_scales, window)

    def prefill_attention(q, k_cache, v_cache, block_table, context_len, scale, kv_scales=NO_SCALES, window=0):
        return ext.paged_prefill_attention(q, k_cache, v_cache, block_table, context_len, scale, *kv_scales, window)

    return Ops("cpu-c++", rms_norm, rotary_qkv_, partial(paged_attention, decode=decode_attention, prefill=prefill_attention,
                                                              prefill_head_dims=tuple(ext.prefill_attention_head_dims)), graph_safe=False,
               lora_add_=lora_add_runs_, fused_experts=partial(fused_experts_cpu, ext))


@dataclass(frozen=True, slots=True)
class Ops:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rotary_qkv_: Callable[..., bool]          # (qkv, rope, heads, kv_heads, head_dim, store=(k_cache, v_cache, slots), kv_scales) -> stored?
    paged_attention: Callable[..., torch.Tensor]  # (q, k, v, k_cache, v_cache, meta, scale, kv_stored=False, kv_scales=NO_SCALES, window=0)
    graph_safe: bool  # a decode step on these ops never reads a device value on the host: a CUDA graph can capture it
    check_shapes: Callable[[int, int], None] = lambda head_dim, block_size: None  # raises for a head_dim / block size they cannot take
    lora_add_: Callable[..., None] = lora_add_ref_  # (y, x, lora_a, lora_b, LoRABatch): y += each row's adapter delta (kernels/lora.py)
    # (x, Experts, weights, ids, act) -> the routed experts' weighted sum (kernels/fused_moe.py); the tokens grouped on the host
    fused_experts: Callable[..., torch.Tensor] = fused_experts_reference


# The torch decode attention sizes its gather by int(context_lens.max()): a host sync, not capturable.
REFERENCE = Ops("reference", rms_norm_ref, rotary_qkv_ref_, partial(paged_attention, decode=decode_attention_grouped), graph_safe=False)

# "default" (or unset): by device; "triton" / "reference": those kernels on any device.
KERNELS_ENV = "KVPILOT_KERNELS"
KERNEL_CHOICES = ("default", "triton", "reference")


def forced_kernels() -> str:
    value = os.environ.get(KERNELS_ENV, "default")
    if value not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(KERNEL_CHOICES)}, not {value!r}")
    return value


def triton_kernels(device: torch.device) -> bool:
    """Whether ops on `device` are the Triton kernels: CUDA's default, anywhere when forced."""
    forced = forced_kernels()
    return forced == "triton" or (forced == "default" and device.type == "cuda")


def _triton_ops() -> Ops:
    from kvpilot.kernels import triton_attention
    from kvpilot.kernels.triton_layers import rms_norm, rotary_qkv_
    from kvpilot.kernels.triton_lora import lora_add_
    from kvpilot.kernels.triton_moe import fused_experts

    return Ops("triton", rms_norm, rotary_qkv_, triton_attention.paged_attention, graph_safe=True, check_shapes=triton_attention.check_shapes,
               lora_add_=lora_add_, fused_experts=fused_experts)


def ops_for(device: torch.device) -> Ops:
    if triton_kernels(device):
        return _triton_ops()
    if device.type == "cpu" and forced_kernels() == "default":
        ext = cpu_extension.load()  # None (logged) when it cannot be built: the references serve
        if ext is not None:
            return _cpu_ops(ext)
    return REFERENCE

