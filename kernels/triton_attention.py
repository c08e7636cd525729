"""Attention over the paged KV cache as Triton kernels for a whole mixed step: the GPU form of the CPU
kernel in kernels/csrc/paged_attention_cpu.cpp (part of the GPU-path issue).

`paged_attention` stores the step's K/V (unless RoPE's kernel already did), then makes two launches at
most: the prefill kernel over every prefilling sequence's rows (plain, chunked, or after a cached
prefix) and the decode kernel over the one-row sequences. Both read every key from the cache, so a
prefill after a cached prefix is no different from a plain one.

Prefill (tiled, flash-attention style): one program per (sequence, tile of BLOCK_M query tokens, KV
head). The tile's queries of all the heads sharing that KV head (GQA) are one [BLOCK_M * GROUP_PAD, D]
matrix, so each K/V block of the sequence is loaded once per tile and multiplied with tl.dot; the
walk stops at the tile's last query position (causal), and masks within the diagonal blocks. The
tile size is BLOCK_M = 64 query rows / GROUP_PAD tokens (at least 16) — not yet tuned on a GPU.

Decode: one program per (sequence, KV head) with the query heads that share it (GQA): it walks the
sequence's block table, loads each block's K rows for its head once for the whole group, and keeps an
online softmax (running max and sum, rescaled accumulators), so K and V are read once and nothing of
the context is materialised.

Split-K (flash-decoding): when the block tables are wider than SPLIT_TOKENS of context, each decode
(sequence, KV head) is split over several programs, each walking SPLIT_TOKENS of the context and
writing its partial (running max, sum, unnormalised output) to float32 buffers, and a second kernel
combines them — so a few long sequences still fill the GPU. The number of splits comes from the
tables' width (a shape), never from the context lengths' values: no host sync, so a CUDA graph can
hold the decode path.

A sliding-window layer (window > 0): each row sees keys p − window < k ≤ p; the walks start at the block
of the first key their rows see, and a row whose first blocks are all before its window keeps a finite
running max (no exp(−inf − −inf)).

An FP8 cache (kvpilot.kernels.paged_attention) reaches the kernels as bytes, widened in registers
(kernels/triton_fp8.py); its k_scale is folded into the softmax scale and its v_scale into the output.
A cache narrower than the queries (bfloat16 under float32, FP8) is widened to their dtype before tl.dot.

float32 softmax whatever the cache's dtype; float32 operands multiply in IEEE float32 (no TF32: the
HF-oracle rule), half-precision ones on the tensor cores with float32 accumulation. head_dim and the
block size must be powers of two (tl.arange) of at least 16 (tl.dot): 64 and 128, 16 and 32 in
practice; anything else is refused by name.

Tested against the torch reference under TRITON_INTERPRET=1 (tests/test_triton_attention.py).
"""

from __future__ import annotations

from itertools import accumulate

import torch
import triton
import triton.language as tl

from kvpilot.kernels.paged_attention import FP8_KV, NO_SCALES, AttentionMetadata, write_kv
from kvpilot.kernels.triton_fp8 import fp8_e4m3_value

SPLIT_TOKENS = 512  # context tokens per program in the split-K form


@triton.jit
def _cache_rows(ptrs, mask, FP8: tl.constexpr):
    """Cache values at ptrs (masked rows 0): an FP8 cache's bytes widened to float32 (unscaled: the
    kernels fold k_scale into the softmax scale and v_scale into the output), else as stored."""
    if FP8:
        return fp8_e4m3_value(tl.load(ptrs, mask=mask, other=0))
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _paged_decode(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, scale, v_scale, num_splits, window,
                  stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_ob, stride_oh, heads_total,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  SPLIT: tl.constexpr, CHUNK: tl.constexpr, KV_FP8: tl.constexpr, WINDOW: tl.constexpr):
    b, g, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    j = tl.arange(0, GROUP_PAD)
    head_ok = j < GROUP
    heads = g * GROUP + j
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=head_ok[:, None], other=0.0).to(tl.float32) * scale
    ctx = tl.load(lens_ptr + b)
    lo = split * CHUNK if SPLIT else 0  # this program's [lo, hi) of the context
    hi = tl.minimum(ctx, lo + CHUNK) if SPLIT else ctx
    first = 0  # the first key the query sees
    if WINDOW:
        first = tl.maximum(ctx - window, 0)
        lo = tl.maximum(lo, first // BLOCK_SIZE * BLOCK_SIZE)  # a split wholly before the window walks nothing
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32)
    t = tl.arange(0, BLOCK_SIZE)
    for start in range(lo, hi, BLOCK_SIZE):
        block = tl.load(tables_ptr + b * stride_tb + start // BLOCK_SIZE)
        tok_ok = (start + t < hi) & (start + t >= first)  # (the range's first block holds a visible key)
        rows = block * stride_kb + t[:, None] * stride_kt + g * stride_kh + d[None, :]
        k = _cache_rows(k_ptr + rows, tok_ok[:, None], KV_FP8).to(tl.float32)  # [BLOCK_SIZE, D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_SIZE]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = _cache_rows(v_ptr + rows, tok_ok[:, None], KV_FP8).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if SPLIT:  # partials [B, H, splits] (and [.., D]); an empty split leaves max -inf, sum 0
        part = (b * heads_total + heads) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=head_ok)
        tl.store(part_l_ptr + part, l_i, mask=head_ok)
        tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=head_ok[:, None])
    else:
        out = acc / l_i[:, None] * v_scale
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _paged_prefill(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, starts_ptr, qlens_ptr, ctx_ptr, scale, v_scale, window,
                   stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_ot, stride_oh,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr, WINDOW: tl.constexpr):
    seq, tile, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(qlens_ptr + seq)
    if tile * BLOCK_M < n:  # the grid covers the longest prefill; shorter ones leave programs idle
        row0 = tl.load(starts_ptr + seq)
        ctx = tl.load(ctx_ptr + seq)
        r = tl.arange(0, BLOCK_M * GROUP_PAD)  # row r: query token tile * BLOCK_M + r // GROUP_PAD, head r % GROUP_PAD of the group
        i = tile * BLOCK_M + r // GROUP_PAD
        j = r % GROUP_PAD
        row_ok = (i < n) & (j < GROUP)
        d = tl.arange(0, D)
        q_rows = (row0 + i) * stride_qt + (g * GROUP + j) * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
        q_pos = ctx - n + i  # absolute positions; rows past n see the whole context (stored nowhere)
        m_i = tl.full((BLOCK_M * GROUP_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M * GROUP_PAD,), tl.float32)
        acc = tl.zeros((BLOCK_M * GROUP_PAD, D), tl.float32)
        t = tl.arange(0, BLOCK_SIZE)
        hi = tl.minimum(ctx, ctx - n + (tile + 1) * BLOCK_M)  # keys after the tile's last query are never seen
        lo = 0
        if WINDOW:  # keys before the tile's first query's window are never seen
            lo = tl.maximum(ctx - n + tile * BLOCK_M - window + 1, 0) // BLOCK_SIZE * BLOCK_SIZE
        for start in range(lo, hi, BLOCK_SIZE):
            block = tl.load(tables_ptr + seq * stride_tb + start // BLOCK_SIZE)
            k_pos = start + t
            kv_rows = block * stride_kb + t[:, None] * stride_kt + g * stride_kh + d[None, :]
            k = _cache_rows(k_ptr + kv_rows, (k_pos < ctx)[:, None], KV_FP8).to(q.dtype)  # a narrower cache widened to q's dtype
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [rows, BLOCK_SIZE]
            visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos < ctx)[None, :]
            if WINDOW:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # without a window key 0 is visible to every row: finite from the first block
            if WINDOW:  # a row that has seen no key yet: a finite max, so its exps are 0 (not NaN)
                m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = _cache_rows(v_ptr + kv_rows, (k_pos < ctx)[:, None], KV_FP8).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / l_i[:, None] * v_scale
        out_rows = (row0 + i) * stride_ot + (g * GROUP + j) * stride_oh
        tl.store(out_ptr + out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _combine_splits(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, v_scale, num_splits, stride_ob, stride_oh, heads_total,
                    SPLITS_PAD: tl.constexpr, D: tl.constexpr):
    """One (sequence, query head): the splits' partial softmaxes rescaled to their common max and summed."""
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    ok = s < num_splits
    part = (b * heads_total + h) * num_splits + s
    m = tl.load(part_m_ptr + part, mask=ok, other=float("-inf"))
    weight = tl.exp(m - tl.max(m, axis=0))  # the last split holding the context's last token is never empty: the max is finite
    weight = tl.where(ok & (m > float("-inf")), weight, 0.0)
    sums = tl.load(part_l_ptr + part, mask=ok, other=0.0)
    d = tl.arange(0, D)
    acc = tl.load(part_acc_ptr + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * sums, axis=0) * v_scale
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_shapes(head_dim: int, block_size: int) -> None:
    """What the kernels take (tl.arange: powers of two; tl.dot: at least 16), refused by name: at load
    (Worker) and at every call."""
    if not (_power_of_two(head_dim) and _power_of_two(block_size) and min(head_dim, block_size) >= 16):
        raise ValueError(f"the Triton attention kernels need a power-of-two head_dim and block size of at least 16, "
                         f"not {head_dim} and {block_size} (use --block-size 16 or 32)")


def _kernel_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The caches as the kernels take them: an FP8 cache as its bytes (and whether it is one)."""
    if k_cache.dtype == FP8_KV:
        return k_cache.view(torch.uint8), v_cache.view(torch.uint8), True
    return k_cache, v_cache, False


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """The shapes both kernels take, refused by name otherwise; returns (GQA group, block size)."""
    heads, head_dim = q.shape[-2:]
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} / {tuple(v_cache.shape)} does not fit queries of head_dim {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    check_shapes(head_dim, block_size)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    return heads // kv_heads, block_size


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # only float32 operands heed it: half ones always use the tensor cores


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, kv_scales: tuple[float, float] = NO_SCALES,
                           split_tokens: int = SPLIT_TOKENS, window: int = 0) -> torch.Tensor:
    """q [B, H, D]; k/v cache [num_blocks, block_size, KVH, D]; block_tables [B, W]; context_lens [B]
    (tokens in the cache, this step's included, each ≥ 1) -> [B, H, D] in q's dtype. The decode
    signature of kernels.paged_attention.paged_attention. Tables wider than split_tokens (a multiple of
    the block size) of context run split-K."""
    batch, heads, head_dim = q.shape
    group, block_size = _check_cache(q, k_cache, v_cache)
    kv_heads = heads // group
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    if split_tokens % block_size:
        raise ValueError(f"split_tokens={split_tokens} must be a multiple of the block size {block_size}")
    out = torch.empty_like(q)
    splits = triton.cdiv(tables.shape[1] * block_size, split_tokens)
    parts = [torch.empty(batch, heads, splits, *shape, dtype=torch.float32, device=q.device) for shape in ((), (), (head_dim,))] \
        if splits > 1 else [out, out, out]  # unused without splits
    k_cache, v_cache, fp8 = _kernel_cache(k_cache, v_cache)
    _paged_decode[(batch, kv_heads, splits)](q, k_cache, v_cache, tables, lens, out, *parts, scale * kv_scales[0], kv_scales[1], splits, window,
                                             q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                             tables.stride(0), out.stride(0), out.stride(1), heads,
                                             GROUP=group, GROUP_PAD=triton.next_power_of_2(group), D=head_dim, BLOCK_SIZE=block_size,
                                             SPLIT=splits > 1, CHUNK=split_tokens, KV_FP8=fp8, WINDOW=window > 0)
    if splits > 1:
        _combine_splits[(batch, heads)](*parts, out, kv_scales[1], splits, out.stride(0), out.stride(1), heads,
                                        SPLITS_PAD=triton.next_power_of_2(splits), D=head_dim)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            max_query_len: int, kv_scales: tuple[float, float] = NO_SCALES, window: int = 0) -> torch.Tensor:
    """Prefilling sequences whose K/V are already in the cache: sequence i's query_lens[i] rows start
    at row query_start[i] of q [T, H, D] and are its last positions of context_lens[i]; block_tables
    [P, W]; max_query_len (a host int) sizes the grid. -> [T, H, D] in q's dtype (rows no sequence
    owns are left unwritten)."""
    heads, head_dim = q.shape[1:]
    group, block_size = _check_cache(q, k_cache, v_cache)
    q = q.contiguous()
    tables = block_tables.contiguous()
    out = torch.empty_like(q)
    group_pad = triton.next_power_of_2(group)
    block_m = max(16, 64 // group_pad)
    grid = (tables.shape[0], triton.cdiv(max_query_len, block_m), heads // group)
    k_cache, v_cache, fp8 = _kernel_cache(k_cache, v_cache)
    _paged_prefill[grid](q, k_cache, v_cache, out, tables, query_start.contiguous(), query_lens.contiguous(), context_lens.contiguous(),
                         scale * kv_scales[0], kv_scales[1], window,
                         q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
                         out.stride(0), out.stride(1), GROUP=group, GROUP_PAD=group_pad, D=head_dim, BLOCK_SIZE=block_size,
                         BLOCK_M=block_m, PRECISION=_precision(q.dtype), KV_FP8=fp8, WINDOW=window > 0)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, kv_stored: bool = False, kv_scales: tuple[float, float] = NO_SCALES,
                    window: int = 0) -> torch.Tensor:
    """kernels.paged_attention.paged_attention's contract (store this step's K/V unless already stored,
    then attend; q [T, heads, d] -> [T, heads, d]): the prefill kernel over the prefilling sequences'
    rows, the decode kernel over the rest."""
    if not kv_stored:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, kv_scales)
    if not meta.prefill_query_lens:
        return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, kv_scales, window=window)
    lens = meta.prefill_query_lens
    if meta.prefill_device is not None:
        starts, query_lens, context_lens, tables = meta.prefill_device
    else:
        starts, query_lens, context_lens = torch.tensor([list(accumulate(lens[:-1], initial=0)), lens, meta.prefill_context_lens]).to(q.device)
        tables = torch.stack(meta.prefill_block_tables)
    prefill_rows = sum(lens)
    out = paged_prefill_attention(q[:prefill_rows], k_cache, v_cache, tables, starts, query_lens, context_lens, scale, max(lens), kv_scales,
                                  window)
    if prefill_rows == q.shape[0]:
        return out
    decoded = paged_decode_attention(q[prefill_rows:], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, kv_scales,
                                     window=window)
    return torch.cat([out, decoded])
