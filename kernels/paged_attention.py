"""Attention over a paged KV cache: the torch references; kernels/ops.py picks the decode kernel.

Cache layout per layer: K and V tensors [num_blocks, block_size, num_kv_heads, head_dim]. A sequence's
token at position p lives in slot block_table[p // block_size] * block_size + p % block_size.
An FP8 cache (float8_e4m3fn, kv_cache_dtype fp8) holds K / k_scale and V / v_scale, rounded to nearest
even and saturated at ±448 (e4m3fn has no infinity); every reader multiplies the scale back. The scales
are one pair per layer, fixed for the engine's life (`kv_scales`; (1.0, 1.0) for any other cache).
A step's tokens are laid out prefills first (each sequence's new tokens one after another), then one
token per decoding sequence.

A sliding-window layer (`window` > 0, Gemma 3's local layers, Mistral v0.1) lets a query at position p
see the keys at p − window < k ≤ p only, as transformers' sliding_window_overlay does; every kernel takes
the window and reads no key before it (0: no window).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("kvpilot.kernels")

HUGE_PAGE = 2 << 20  # x86-64's and arm64's transparent huge page
_MADV_HUGEPAGE = 14
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


@functools.cache
def _log_small_pages(errno: int) -> None:
    log.info("madvise(MADV_HUGEPAGE) refused (errno %d): the KV cache stays on small pages (slower decode attention)", errno)


def kv_cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's K or V cache, zeroed. On a CPU, on transparent huge pages where the kernel gives them
    (madvise, before the pages are first touched): a decode step walks every sequence's blocks, scattered
    over the cache, and on 4 KiB pages each walk missed the TLB at every few blocks — on the 2-core
    AVX-512 VM the C++ decode attention read 12.4 GB/s of a 1.9 GB cache against 17.2 on huge pages, and
    the engine's 16-client decode attention took 0.56x the time (bench/history/, #65). A kernel without
    THP (or `never`) leaves the advice unused: the same cache on 4 KiB pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or _libc is None or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8, device="cpu")
    start = -raw.data_ptr() % HUGE_PAGE
    if _libc.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(nbytes // HUGE_PAGE * HUGE_PAGE), _MADV_HUGEPAGE) != 0:
        _log_small_pages(ctypes.get_errno())
    return raw[start:start + nbytes].view(dtype).view(shape).zero_()


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor           # [num_tokens] long: cache slot each new token's K/V goes to
    prefill_query_lens: list[int]        # new tokens of each prefilling sequence
    prefill_context_lens: list[int]      # its tokens in cache after this step (cached prefix + new)
    prefill_block_tables: list[torch.Tensor]  # [blocks] long each
    decode_block_tables: torch.Tensor    # [num_decodes, max_blocks] long (padded with 0)
    decode_context_lens: torch.Tensor    # [num_decodes] long, including the new token
    # The prefills' (query starts, query lengths, context lengths) [P] and block tables [P, blocks], long,
    # on the device, when the step has them there (from_input): what a device kernel reads, instead of
    # uploading the host lists in every layer (a blocking copy, which would stall async scheduling).
    prefill_device: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # The same step for the sliding-window layers when their caches are a pool of their own (block_manager.WindowPool):
    # their slots and block tables; None: every layer reads these.
    window: AttentionMetadata | None = None

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_query_lens)

    @classmethod
    def one_prefill(cls, tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
        """One sequence's whole prefill of `tokens` tokens into blocks 0.. (profiling, scoring, calibration)."""
        none = torch.zeros(0, dtype=torch.long, device=device)
        table = torch.arange(-(-tokens // block_size), device=device)
        return cls(torch.arange(tokens, device=device), [tokens], [tokens], [table], none.view(0, 0), none)

    @classmethod
    def from_input(cls, inp) -> AttentionMetadata:
        """From a step's ModelInput (kvpilot.server.engine.model_io): prefills first, then decodes; the
        block tables are views of its one padded tensor (no per-sequence upload)."""
        p = inp.num_prefills
        starts = inp.query_start_loc[:p]

        def of(slots: torch.Tensor, tables: torch.Tensor) -> AttentionMetadata:
            device = (starts, inp.query_start_loc[1:p + 1] - starts, inp.seq_lens[:p], tables[:p]) if p else None
            return cls(slots, inp.query_lens, inp.context_lens, [tables[i] for i in range(p)], tables[p:], inp.seq_lens[p:], device)

        meta = of(inp.slot_mapping, inp.block_tables)
        if inp.window_block_tables is not None:
            meta.window = of(inp.window_slot_mapping, inp.window_block_tables)
        return meta


FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
NO_SCALES = (1.0, 1.0)


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as float8_e4m3fn: float32 division, saturated, rounded to nearest even (torch's
    conversion; the C++ and Triton stores round the same way, bit for bit)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV)


def dequantize(rows: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows in `dtype`: an FP8 cache's values times its scale (in float32), others converted."""
    if rows.dtype == FP8_KV:
        return (rows.float() * scale).to(dtype)
    return rows.to(dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: tuple[float, float] = NO_SCALES) -> None:
    """Store new tokens' K/V [T, kv_heads, head_dim] at their slots."""
    kv_heads, head_dim = k_cache.shape[-2:]
    for cache, x, scale in ((k_cache, k, kv_scales[0]), (v_cache, v, kv_scales[1])):
        if cache.dtype == FP8_KV:  # (torch has no index_copy_ for float8 types: the bytes are copied)
            cache.view(torch.uint8).view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, quantize_fp8(x, scale).view(torch.uint8))
        else:  # a narrower cache (kv_cache_dtype bfloat16 under float32) rounds
            cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, x.to(cache.dtype))


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table[..., positions // block_size] * block_size + positions % block_size


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, context_len: int, scale: float,
                          kv_scales: tuple[float, float] = NO_SCALES, window: int = 0) -> torch.Tensor:
    """One sequence's new tokens q/k/v [n, heads, d] attend causally to its cached prefix and themselves
(with an FP8 cache, their K/V rounded as stored).

    Only the prefix (positions before this step's tokens) is read from the cache, whole blocks at a time
    into one buffer that the new tokens' K/V (used as computed) complete: a plain prefill copies nothing."""
    n = q.shape[0]
    prefix = context_len - n
    if k_cache.dtype == FP8_KV:  # the new tokens' K/V as the cache holds them: a later prefix hit then reads what this step used
        k, v = (dequantize(quantize_fp8(x, s), s, x.dtype) for x, s in ((k, kv_scales[0]), (v, kv_scales[1])))
    # A window's first query sees nothing before its window: the blocks before it are not read.
    first = max(0, prefix + 1 - window) // k_cache.shape[1] if window else 0
    if prefix:
        k, v = (_with_prefix(x, cache, block_table, prefix, s, first) for x, cache, s in ((k, k_cache, kv_scales[0]), (v, v_cache, kv_scales[1])))
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if window and context_len > window:  # some query sees less than its whole past: an explicit mask
        q_pos = torch.arange(prefix, context_len, device=q.device)[:, None]
        k_pos = torch.arange(first * k_cache.shape[1] if prefix else 0, context_len, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=(k_pos <= q_pos) & (k_pos > q_pos - window), scale=scale, enable_gqa=True)
    elif not prefix:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    elif n == 1:  # the last position sees everything: no mask
        out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=True)
    else:  # new query i sits at absolute position prefix + i
        q_pos = torch.arange(prefix, context_len, device=q.device)
        mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def _with_prefix(new: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, prefix: int, scale: float, first: int = 0) -> torch.Tensor:
    """[prefix − first·block_size + n, kv_heads, d]: the prefix's rows from block `first` on, from the cache,
    then `new`. Whole blocks are copied (contiguous rows: memcpy speed, several times a token-by-token
    gather's) straight into the buffer."""
    block_size = cache.shape[1]
    start = first * block_size
    out = torch.empty((prefix - start + new.shape[0], *new.shape[1:]), dtype=new.dtype, device=new.device)
    whole = prefix // block_size
    if whole > first:
        blocks = out[:(whole - first) * block_size].view(whole - first, *cache.shape[1:])
        tables = block_table[first:whole]
        if cache.dtype == new.dtype:
            torch.index_select(cache, 0, tables, out=blocks)
        elif cache.dtype == FP8_KV:
            blocks.copy_(dequantize(cache.view(torch.uint8).index_select(0, tables).view(FP8_KV), scale, new.dtype))
        else:
            blocks.copy_(cache.index_select(0, tables))
    if whole * block_size < prefix:
        out[whole * block_size - start:prefix - start] = dequantize(cache[block_table[whole], :prefix - whole * block_size], scale, new.dtype)
    out[prefix - start:] = new
    return out


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                         scale: float, kv_scales: tuple[float, float] = NO_SCALES, window: int = 0) -> torch.Tensor:
    """One query token per sequence q [B, heads, d] over its cached context; returns [B, heads, d].

    Whole blocks are gathered (rows of block_size x kv_heads x head_dim contiguous values): on CPU
    that copy runs at memcpy speed, several times faster than gathering token by token."""
    batch = q.shape[0]
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    if window:  # each sequence's blocks from the one holding its window's first key (none before it is read)
        first = (context_lens - window).clamp(min=0) // block_size
        cols = first[:, None] + torch.arange(int((-(-context_lens // block_size) - first).max()), device=q.device)
        tables = block_tables.gather(1, cols.clamp(max=block_tables.shape[1] - 1))
        positions = (cols[:, :, None] * block_size + torch.arange(block_size, device=q.device)).flatten(1)  # [B, L]
        mask = (positions < context_lens[:, None]) & (positions >= context_lens[:, None] - window)
    else:
        max_blocks = -(-int(context_lens.max()) // block_size)
        tables = block_tables[:, :max_blocks]
        mask = torch.arange(max_blocks * block_size, device=q.device)[None, :] < context_lens[:, None]
    span = tables.shape[1] * block_size
    k = dequantize(k_cache[tables], kv_scales[0], q.dtype).view(batch, span, kv_heads, head_dim).transpose(1, 2)  # [B, kv_heads, L, d]
    v = dequantize(v_cache[tables], kv_scales[1], q.dtype).view(batch, span, kv_heads, head_dim).transpose(1, 2)
    mask = mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, kv_stored: bool = False, kv_scales: tuple[float, float] = NO_SCALES,
                    window: int = 0, decode=None, prefill=None, prefill_head_dims: tuple[int, ...] = ()) -> torch.Tensor:
    """Write this step's K/V [T, kv_heads, d] into the cache (unless the caller already did), then
    attend; q [T, heads, d] -> [T, heads, d]. decode(q, k_cache, v_cache, block_tables, context_lens,
    scale, kv_scales) is the decode kernel (default: the torch reference); prefill(q, k_cache, v_cache,
    block_table, context_len, scale, kv_scales) attends one sequence's new tokens over the cache (which
    holds their K/V by then), for prefills of up to PREFILL_KERNEL_TOKENS tokens at the head dims it is
    fast for; both take `window` as a keyword."""
    decode = decode or decode_attention_grouped
    if not kv_stored:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, kv_scales)
    if not meta.prefill_query_lens:  # a decode-only step: no output buffer to assemble
        return decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, kv_scales, window=window)
    out = torch.empty_like(q)
    start = 0
    for n, ctx, table in zip(meta.prefill_query_lens, meta.prefill_context_lens, meta.prefill_block_tables):
        rows = slice(start, start + n)
        if n <= PREFILL_KERNEL_TOKENS and q.shape[-1] in prefill_head_dims and k_cache.dtype == q.dtype:  # (not FP8: below)
            out[rows] = prefill(q[rows], k_cache, v_cache, table, ctx, scale, kv_scales, window=window)
        elif ctx > n and n * ctx <= SHORT_TAIL_WORK and k_cache.dtype == q.dtype:
            # A short tail over a cached prefix (a prompt whose prefix was cached, a small chunk): each new token as
            # one decode query over the cache, which holds its K/V by now — the values the reference path uses,
            # without copying the prefix out of its blocks. (Not for an FP8 cache: there a prefix hit must repeat its
            # miss's arithmetic too, since e4m3's rounding of the next layers' K/V magnifies a last-bit difference.)
            lens = torch.arange(ctx - n + 1, ctx + 1, device=q.device)
            out[rows] = decode(q[rows], k_cache, v_cache, table[None].expand(n, -1).contiguous(), lens, scale, kv_scales, window=window)
        else:
            out[rows] = prefill_attention_ref(q[rows], k[rows], v[rows], k_cache, v_cache, table, ctx, scale, kv_scales, window)
        start += n
    if start < q.shape[0]:
        out[start:] = decode(q[start:], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, kv_scales, window=window)
    return out


DECODE_GROUP = 4  # sequences per padded decode-attention call on the torch path
# The C++ prefill kernel (one KV head's queries over a range of the cache at a time) vs the copy-and-SDPA path, 2-core
# AVX-512 host, SmolLM2's shapes: 3.0x at 8 new tokens over 4,000 cached, 1.15x at 512 over 1,536-3,584, parity for a
# plain 512-token prefill, 0.70x for a plain 2,000-token one (bench/prefix_attention.py, bench/history/).
PREFILL_KERNEL_TOKENS = 512
# Where the prefill kernel is not used (AVX2 builds, other head dims), a prefill of n new tokens over a cached prefix
# (context ctx) runs as n decode queries while n · ctx is at most this; beyond it the prefix copied out of its blocks once and one masked SDPA are cheaper. On a 2-core AVX-512
# host, SmolLM2's shapes, the C++ decode kernel vs that path: 5.5x at 1 token over 4,000, 1.19x at 8 over 4,000,
# 1.23x at 16 over 2,000, 2.0x at 32 over 1,000, and 0.93x at 12 over 4,000 (bench/history/).
SHORT_TAIL_WORK = 40_000


def decode_attention_grouped(q, k_cache, v_cache, block_tables, context_lens, scale, kv_scales=NO_SCALES, window=0):
    """The torch decode path: sequences sorted by context length and taken in small groups, so each
    group is padded only to its own longest context."""
    n = q.shape[0]
    if n <= DECODE_GROUP:
        return decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, kv_scales, window)
    order = torch.argsort(context_lens)
    out = torch.empty_like(q)
    for i in range(0, n, DECODE_GROUP):
        idx = order[i:i + DECODE_GROUP]
        out[idx] = decode_attention_ref(q[idx], k_cache, v_cache, block_tables[idx], context_lens[idx], scale, kv_scales, window)
    return out
