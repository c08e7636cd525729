"""The fused-experts op in Triton (kernels/fused_moe.py has the contract): the step's (token, slot) pairs sorted by
expert on the device, each expert's segment padded to whole blocks of BLOCK_M rows, so that every program multiplies
rows of one expert by that expert's weights (read once per block of rows). Two launches: the gate and up halves of w13
with the activation and their product in the epilogue, then w2 with each pair's routing weight; the slots of a token
are summed in float32. Nothing reads a device value on the host (the grid is the most blocks any routing can need;
blocks past the step's are skipped on the device). Experts dense (float32 / half types), or in GGUF blocks
(ExpertBlocks: each weight tile dequantized in registers by triton_gguf's dequantized_tile, so a quantized expert's bytes
are what is read). Tested against the reference under TRITON_INTERPRET=1 (tests/test_moe.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.fused_moe import ExpertBlocks, Experts, fused_experts_reference
from kvpilot.kernels.quantized import LAYOUTS
from kvpilot.kernels.triton_gguf import dequantized_tile, layout_constants

BLOCK_M = 16


@triton.jit
def _expert_rows(a_ptr, w_ptr, d_ptr, m_ptr, out_ptr, pairs_ptr, block_expert_ptr, weights_ptr, N, K, stride_a, stride_we, stride_wn,
                 stride_wk, stride_de, stride_me, stride_out, up_rows, TOP_K: tl.constexpr, GATED: tl.constexpr, GELU: tl.constexpr,
                 WEIGHTED: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr, CODE_BITS: tl.constexpr, FP8: tl.constexpr,
                 GROUP: tl.constexpr, MIN: tl.constexpr, SUPER: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns pid_n of block pid_m's rows times its expert's weights. pairs: each row's pair (t * TOP_K + j; -1: padding);
    GATED: a's rows are the pairs' tokens, out = act(a @ gate.T) * (a @ up.T), up the rows `up_rows` on; else a's rows
    are the pairs' own (the activations) and out = a @ w.T, times each pair's weight when WEIGHTED. out's row: the pair.
    QUANT: the weights in GGUFWeight's row layout (w: the codes, d and m beside them; CODE_BITS… describe it), each
    tile dequantized in registers to a's dtype; else dense, read by their strides."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair >= 0
    row = tl.where(valid, pair // TOP_K if GATED else pair, 0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    d_base, m_base = d_ptr + expert.to(tl.int64) * stride_de, m_ptr + expert.to(tl.int64) * stride_me
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + row[:, None] * stride_a + k[None, :], mask=valid[:, None] & (k[None, :] < K), other=0.0)
        w_mask = (n[None, :] < N) & (k[:, None] < K)
        if QUANT:  # (K is a whole number of blocks, BLOCK_K one of them)
            w = dequantized_tile(w_base, d_base, m_base, n, n < N, k, K, CODE_BITS, FP8, GROUP, MIN, SUPER).to(a_ptr.dtype.element_ty)
        else:
            w = tl.load(w_base + n[None, :] * stride_wn + k[:, None] * stride_wk, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a.to(w.dtype), w, input_precision=PRECISION)
        if GATED:
            if QUANT:
                w_up = dequantized_tile(w_base, d_base, m_base, n + up_rows, n < N, k, K, CODE_BITS, FP8, GROUP, MIN, SUPER).to(a_ptr.dtype.element_ty)
            else:
                w_up = tl.load(w_base + (n[None, :] + up_rows) * stride_wn + k[:, None] * stride_wk, mask=w_mask, other=0.0)
            acc_up += tl.dot(a.to(w_up.dtype), w_up, input_precision=PRECISION)
    if GATED:
        if GELU:  # tanh approximation: tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            acc = 0.5 * acc * (2.0 * tl.sigmoid(2.0 * z)) * acc_up
        else:
            acc = acc * tl.sigmoid(acc) * acc_up
    if WEIGHTED:
        acc *= tl.load(weights_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + tl.where(valid, pair, 0)[:, None] * stride_out + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (n[None, :] < N))


def _blocks_by_expert(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [blocks * block_m]: each row's pair id, -1 for padding; block_expert [blocks]: each block's expert, -1 past
    the step's), for the most blocks any routing of these pairs can need, all on the device."""
    flat = ids.flatten()
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)  # pair ids, grouped by expert
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in `order`
    expert_of = flat[order]
    rank = torch.arange(pairs, device=ids.device) - first[expert_of]
    blocks = triton.cdiv(pairs, block_m) + experts  # enough whatever the routing: each expert pads at most one block
    rows = torch.full((blocks * block_m,), -1, dtype=torch.int64, device=ids.device)
    rows[padded_end[expert_of] - padded[expert_of] + rank] = order
    starts = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    return rows, torch.where(starts < padded_end[-1], block_expert, -1)


def _weight_args(dense: torch.Tensor | None, blocks: ExpertBlocks | None) -> tuple[tuple, dict]:
    """_expert_rows' weight arguments (w, d, m, stride_we, stride_wn, stride_wk, stride_de, stride_me) and compile-time
    constants for dense experts [experts, out, in] or blocks."""
    if blocks is None:
        return (dense, dense, dense, dense.stride(0), dense.stride(1), dense.stride(2), 0, 0), \
            {"QUANT": False, "CODE_BITS": 0, "FP8": False, "GROUP": 1, "MIN": 0, "SUPER": False}
    layout = LAYOUTS[blocks.kind]
    qs = blocks.qs.view(torch.int8) if layout.code_bits == 8 and not layout.fp8 else blocks.qs  # (int8 codes load signed)
    m = blocks.m if blocks.m is not None else blocks.d
    return (qs, blocks.d, m, qs.stride(0), 0, 0, blocks.d.stride(0), m.stride(0)), {"QUANT": True, **layout_constants(blocks.kind)}


def fused_experts(x: torch.Tensor, experts: Experts, weights: torch.Tensor, ids: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """kernels.ops' fused_experts on CUDA (and under TRITON_INTERPRET=1): dense or block-quantized experts in Triton,
    others (the C++ kernels' panels) the reference."""
    if experts.panels is not None or x.stride(-1) != 1 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return fused_experts_reference(x, experts, weights, ids, act)
    b13, b2 = experts.blocks or (None, None)
    (w13, *rest13), quant13 = _weight_args(experts.w13, b13)
    (w2, *rest2), quant2 = _weight_args(experts.w2, b2)
    tokens, top_k = ids.shape
    num_experts, inner, hidden = w13.shape[0], experts.inner, x.shape[1]
    x = x.contiguous()
    rows, block_expert = _blocks_by_expert(ids, num_experts, BLOCK_M)
    pairs = ids.numel()
    gated = torch.empty(pairs, inner, dtype=x.dtype, device=x.device)
    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    flat_weights = weights.float().contiguous().view(-1)
    grid = lambda n: (block_expert.shape[0], triton.cdiv(n, 64))  # noqa: E731
    d13, m13, we13, wn13, wk13, de13, me13 = rest13
    _expert_rows[grid(inner)](x, w13, d13, m13, gated, rows, block_expert, flat_weights, inner, hidden, x.stride(0), we13, wn13, wk13, de13,
                              me13, gated.stride(0), inner, TOP_K=top_k, GATED=True, GELU=act == "gelu_tanh", WEIGHTED=False,
                              PRECISION=precision, **quant13, BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_K=32)
    d2, m2, we2, wn2, wk2, de2, me2 = rest2
    _expert_rows[grid(hidden)](gated, w2, d2, m2, out, rows, block_expert, flat_weights, hidden, inner, gated.stride(0), we2, wn2, wk2, de2,
                               me2, out.stride(0), 0, TOP_K=top_k, GATED=False, GELU=False, WEIGHTED=True,
                               PRECISION=precision, **quant2, BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_K=32)
    return out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
