"""Attention over the paged KV cache as one Triton kernel for a whole mixed step: the GPU form of the
CPU kernel in kernels/csrc/paged_attention_cpu.cpp (part of the GPU-path issue).

`paged_attention` hands every token of the step to the decode kernel as its own query row — a decode
token with its sequence's context, a prefill token (plain, chunked, or after a cached prefix) with the
context up to and including itself, which is exactly the causal mask — so one launch covers prefills
and decodes alike, with no per-sequence loop on the GPU side. Each program re-reads its context, so a
long prompt costs O(n²) reads: a tiled prefill kernel (queries of a sequence sharing each K/V block)
is the next step, to be measured on a GPU.

Split-K (flash-decoding): when the block tables are wider than SPLIT_TOKENS of context, each (sequence,
KV head) is split over several programs, each walking SPLIT_TOKENS of the context and writing its
partial (running max, sum, unnormalised output) to float32 buffers, and a second kernel combines them
— so a few long sequences still fill the GPU. The number of splits comes from the tables' width (a
shape), never from the context lengths' values: no host sync, so a CUDA graph can hold it.

One program per (sequence, KV head) with the query heads that share it (GQA): it walks the sequence's
block table, loads each block's K rows for its head once for the whole group, and keeps an online
softmax (running max and sum, rescaled accumulators), so K and V are read once and nothing of the
context is materialised. float32 math whatever the cache's dtype. head_dim and the block size must
be powers of two (tl.arange): 64 and 128, 16 and 32 in practice; anything else is refused by name.

Tested against the torch reference under TRITON_INTERPRET=1 (tests/test_triton_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.paged_attention import AttentionMetadata, write_kv

SPLIT_TOKENS = 512  # context tokens per program in the split-K form


@triton.jit
def _paged_decode(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, scale, num_splits,
                  stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_ob, stride_oh, heads_total,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  SPLIT: tl.constexpr, CHUNK: tl.constexpr):
    b, g, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    j = tl.arange(0, GROUP_PAD)
    head_ok = j < GROUP
    heads = g * GROUP + j
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=head_ok[:, None], other=0.0).to(tl.float32) * scale
    ctx = tl.load(lens_ptr + b)
    lo = split * CHUNK if SPLIT else 0  # this program's [lo, hi) of the context
    hi = tl.minimum(ctx, lo + CHUNK) if SPLIT else ctx
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32)
    t = tl.arange(0, BLOCK_SIZE)
    for start in range(lo, hi, BLOCK_SIZE):
        block = tl.load(tables_ptr + b * stride_tb + start // BLOCK_SIZE)
        tok_ok = start + t < hi
        rows = block * stride_kb + t[:, None] * stride_kt + g * stride_kh + d[None, :]
        k = tl.load(k_ptr + rows, mask=tok_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_SIZE, D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_SIZE]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + rows, mask=tok_ok[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if SPLIT:  # partials [B, H, splits] (and [.., D]); an empty split leaves max -inf, sum 0
        part = (b * heads_total + heads) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=head_ok)
        tl.store(part_l_ptr + part, l_i, mask=head_ok)
        tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=head_ok[:, None])
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _combine_splits(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, num_splits, stride_ob, stride_oh, heads_total,
                    SPLITS_PAD: tl.constexpr, D: tl.constexpr):
    """One (sequence, query head): the splits' partial softmaxes rescaled to their common max and summed."""
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    ok = s < num_splits
    part = (b * heads_total + h) * num_splits + s
    m = tl.load(part_m_ptr + part, mask=ok, other=float("-inf"))
    weight = tl.exp(m - tl.max(m, axis=0))  # split 0 always holds tokens (contexts are >= 1): the max is finite
    weight = tl.where(ok & (m > float("-inf")), weight, 0.0)
    sums = tl.load(part_l_ptr + part, mask=ok, other=0.0)
    d = tl.arange(0, D)
    acc = tl.load(part_acc_ptr + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * sums, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, split_tokens: int = SPLIT_TOKENS) -> torch.Tensor:
    """q [B, H, D]; k/v cache [num_blocks, block_size, KVH, D]; block_tables [B, W]; context_lens [B]
    (tokens in the cache, this step's included, each ≥ 1) -> [B, H, D] in q's dtype. The decode
    signature of kernels.paged_attention.paged_attention. Tables wider than split_tokens (a multiple of
    the block size) of context run split-K."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} / {tuple(v_cache.shape)} does not fit queries of head_dim {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if not (_power_of_two(head_dim) and _power_of_two(block_size)):
        raise ValueError(f"the Triton decode kernel needs a power-of-two head_dim and block size, not {head_dim} and {block_size}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    if split_tokens % block_size:
        raise ValueError(f"split_tokens={split_tokens} must be a multiple of the block size {block_size}")
    out = torch.empty_like(q)
    group = heads // kv_heads
    splits = triton.cdiv(tables.shape[1] * block_size, split_tokens)
    parts = [torch.empty(batch, heads, splits, *shape, dtype=torch.float32, device=q.device) for shape in ((), (), (head_dim,))] \
        if splits > 1 else [out, out, out]  # unused without splits
    _paged_decode[(batch, kv_heads, splits)](q, k_cache, v_cache, tables, lens, out, *parts, scale, splits,
                                             q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                             tables.stride(0), out.stride(0), out.stride(1), heads,
                                             GROUP=group, GROUP_PAD=triton.next_power_of_2(group), D=head_dim, BLOCK_SIZE=block_size,
                                             SPLIT=splits > 1, CHUNK=split_tokens)
    if splits > 1:
        _combine_splits[(batch, heads)](*parts, out, splits, out.stride(0), out.stride(1), heads,
                                        SPLITS_PAD=triton.next_power_of_2(splits), D=head_dim)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, kv_stored: bool = False) -> torch.Tensor:
    """kernels.paged_attention.paged_attention's contract (store this step's K/V unless already stored,
    then attend; q [T, heads, d] -> [T, heads, d]) in one kernel launch for the whole step."""
    if not kv_stored:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    if not meta.prefill_query_lens:
        return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    # Prefill token i of a sequence with `ctx` tokens after this step sits at position ctx - n + i: it
    # sees ctx - n + i + 1 of them.
    lens = [torch.arange(ctx - n + 1, ctx + 1, device=q.device) for n, ctx in zip(meta.prefill_query_lens, meta.prefill_context_lens)]
    width = max([t.shape[-1] for t in meta.prefill_block_tables] + [meta.decode_block_tables.shape[-1]])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1]))
    tables = [pad(t).expand(n, width) for n, t in zip(meta.prefill_query_lens, meta.prefill_block_tables)]
    if meta.decode_context_lens.numel():
        lens.append(meta.decode_context_lens)
        tables.append(pad(meta.decode_block_tables))
    return paged_decode_attention(q, k_cache, v_cache, torch.cat(tables), torch.cat(lens), scale)
