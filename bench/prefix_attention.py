"""The CPU prefill attention over a cached prefix (kernels/paged_attention.py, prefill_attention_ref):
a chunk or a prompt's tail of n new tokens attending to a long prefix held in the paged cache, per 30
layers (SmolLM2-135M's shapes: 9 query heads, 3 KV heads, head_dim 64, block_size 16, float32).
Its peers in the same run: the token-by-token gather it replaced (a slot index per prefix token, then one
concatenation with the new K/V), inlined here; the C++ decode kernel with one query per new token over
the cache (what paged_attention runs for a short tail, n · context <= SHORT_TAIL_WORK, where the prefill
kernel is not used); and the C++ prefill kernel (a KV head's query rows over ranges of the cache: what the
CPU ops run for up to PREFILL_KERNEL_TOKENS new tokens at head_dim 64/128 on AVX-512 hosts); all are
checked to agree.

    .venv/bin/python bench/prefix_attention.py [--force] [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine, refuse_if_busy, table  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def token_gather(q, k, v, k_cache, v_cache, block_table, context_len, scale):
    """The previous implementation: the prefix gathered token by token, concatenated with the new K/V."""
    import torch
    import torch.nn.functional as F

    n = q.shape[0]
    prefix = context_len - n
    positions = torch.arange(prefix)
    slots = block_table[positions // BLOCK] * BLOCK + positions % BLOCK
    k = torch.cat([k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots], k])
    v = torch.cat([v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots], v])
    mask = torch.arange(context_len)[None, :] <= torch.arange(prefix, context_len)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
                                          enable_gqa=True).transpose(0, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    import torch

    from kvpilot.kernels import cpu_extension
    from kvpilot.kernels.paged_attention import PREFILL_KERNEL_TOKENS, SHORT_TAIL_WORK, prefill_attention_ref, write_kv

    ext = cpu_extension.require()

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(2048, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(2048, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)

    def per_layers(fn, *a) -> float:
        t = time.perf_counter()
        for _ in range(LAYERS):
            fn(*a)
        return (time.perf_counter() - t) * 1000

    rows = []
    for n, prefix in ((1, 4000), (8, 4000), (16, 4000), (16, 4008), (16, 2000), (32, 1000), (256, 2048), (512, 1536), (512, 0)):
        ctx = prefix + n
        table_ = torch.randperm(2048, generator=gen)[: -(-ctx // BLOCK)]
        q, k, v = (torch.randn(n, h, HEAD_DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
        positions = torch.arange(prefix, ctx)
        write_kv(k_cache, v_cache, k, v, table_[positions // BLOCK] * BLOCK + positions % BLOCK)  # the new K/V in the cache, as the engine has them
        a = (q, k, v, k_cache, v_cache, table_, ctx, HEAD_DIM ** -0.5)
        d = (q, k_cache, v_cache, table_[None].expand(n, -1).contiguous(), torch.arange(prefix + 1, ctx + 1), HEAD_DIM ** -0.5)
        torch.testing.assert_close(prefill_attention_ref(*a), token_gather(*a), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ext.paged_decode_attention(*d), token_gather(*a), atol=1e-5, rtol=1e-5)
        p = (q, k_cache, v_cache, table_, ctx, HEAD_DIM ** -0.5)
        torch.testing.assert_close(ext.paged_prefill_attention(*p), token_gather(*a), atol=1e-5, rtol=1e-5)
        before, after, per_token, tiled = [], [], [], []
        for _ in range(args.rounds):  # interleaved
            before.append(per_layers(token_gather, *a))
            after.append(per_layers(prefill_attention_ref, *a))
            per_token.append(per_layers(ext.paged_decode_attention, *d))
            tiled.append(per_layers(ext.paged_prefill_attention, *p))
        b, w, t, k = (statistics.median(x) for x in (before, after, per_token, tiled))
        tiled_here = n <= PREFILL_KERNEL_TOKENS and HEAD_DIM in ext.prefill_attention_head_dims
        rows.append({"new tokens": n, "prefix": prefix, "token gather ms": f"{b:.1f}", "block copy ms": f"{w:.1f}", "speed-up": f"{b / w:.2f}×",
                     "decode kernel ms": f"{t:.1f}", "vs block copy": f"{w / t:.2f}×", "prefill kernel ms": f"{k:.1f}",
                     "its vs block copy": f"{w / k:.2f}×",
                     "engine runs": "prefill kernel" if tiled_here else "decode kernel" if n * ctx <= SHORT_TAIL_WORK else "block copy"})
    print(f"machine: {machine()}; threads {args.threads}; {LAYERS} layers per figure; rounds {args.rounds} (median)")
    print(table(rows, ["new tokens", "prefix", "token gather ms", "block copy ms", "speed-up", "decode kernel ms", "vs block copy",
                       "prefill kernel ms", "its vs block copy", "engine runs"]))


if __name__ == "__main__":
    main()
