"""The Triton paged attention kernels (kernels/triton_attention.py: decode, split-K decode, tiled
prefill) against a naive per-sequence attention over contiguous K/V, under TRITON_INTERPRET=1 on CPU:
GQA groups of 1, 3 and 4 (padded to a power of two inside the kernels), head_dim 64 and 128, block
sizes 16 and 32, ragged contexts that end inside, at and one past a block boundary, prefills after a
cached prefix and across query tiles, float32 and float16."""

from itertools import accumulate

import pytest
import torch
from test_paged_attention import decode_case, naive, paged

from kvpilot.kernels.triton_attention import paged_decode_attention, paged_prefill_attention


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 64, 16), (8, 2, 64, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_matches_naive(heads, kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(heads * 10 + block_size)
    lens = [block_size, block_size + 1, 3 * block_size - 1, 1, 70]
    ks, vs, kc, vc, bt, q = decode_case(lens, heads, kv_heads, head_dim, block_size, gen, spare_blocks=4)
    out = paged_decode_attention(q.to(dtype), kc.to(dtype), vc.to(dtype), bt, torch.tensor(lens), head_dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for i, n in enumerate(lens):
        ks_i, vs_i = (x.to(dtype).float() for x in (ks[i], vs[i]))
        ref = naive(q[i:i + 1].to(dtype).float(), ks_i, vs_i, head_dim ** -0.5, n - 1)
        torch.testing.assert_close(out[i:i + 1].float(), ref, atol=tol, rtol=tol)


def test_shapes_it_cannot_take_are_refused_by_name():
    q = torch.randn(1, 4, 48)
    cache = torch.zeros(4, 16, 2, 48)
    with pytest.raises(ValueError, match="power-of-two head_dim and block size of at least 16, not 48 and 16"):
        paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), 1.0)
    small_blocks = torch.zeros(4, 8, 2, 64)
    with pytest.raises(ValueError, match="not 64 and 8 .use --block-size 16 or 32"):
        paged_prefill_attention(torch.randn(1, 4, 64), small_blocks, small_blocks, torch.zeros(1, 1, dtype=torch.long),
                                torch.tensor([0]), torch.tensor([1]), torch.tensor([1]), 1.0, 1)
    with pytest.raises(ValueError, match="not a multiple of 3 KV heads"):
        paged_decode_attention(torch.randn(1, 4, 64), torch.zeros(4, 16, 3, 64), torch.zeros(4, 16, 3, 64),
                               torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), 1.0)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_matches_naive(heads, kv_heads, head_dim, block_size, dtype):
    """Prefills whose K/V are in the cache: plain ones of one token, of a block, one past it and longer
    than a query tile (so several tiles and the causal stop at each), and chunks after cached prefixes
    ending inside and at a block boundary."""
    gen = torch.Generator().manual_seed(heads + block_size)
    contexts = [1, block_size, block_size + 1, 70, 3 * block_size, 2 * block_size + 5]
    new = [1, block_size, block_size + 1, 70, block_size + 3, 4]  # the last two after a cached prefix
    ks = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in contexts]
    vs = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in contexts]
    kc, vc, tables = paged(ks, vs, block_size, sum(-(-n // block_size) for n in contexts) + 3, gen)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    starts = list(accumulate(new[:-1], initial=0))
    q = torch.randn(sum(new), heads, head_dim, generator=gen)
    out = paged_prefill_attention(q.to(dtype), kc.to(dtype), vc.to(dtype), bt, torch.tensor(starts), torch.tensor(new),
                                  torch.tensor(contexts), head_dim ** -0.5, max(new))
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for s, n, ctx, k, v in zip(starts, new, contexts, ks, vs):
        want = naive(q[s:s + n].to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), head_dim ** -0.5, ctx - n)
        torch.testing.assert_close(out[s:s + n].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_mixed_step_matches_the_reference(dtype):
    """Two prefills (one after a cached prefix of 21 tokens, one plain) and three decodes, the K/V of
    the step written by the kernel's caller as in the engine: the same output as the torch reference
    (two launches: the prefill kernel, then the decode kernel)."""
    from kvpilot.kernels import triton_attention
    from kvpilot.kernels.paged_attention import AttentionMetadata, paged_attention

    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, d, bs, blocks = 6, 2, 64, 16, 40
    prefix, new, plain, decode_ctx = 21, 9, 13, [5, 17, 40]
    kc, vc = torch.randn(blocks, bs, kv_heads, d, generator=gen), torch.randn(blocks, bs, kv_heads, d, generator=gen)
    free = torch.randperm(blocks, generator=gen).tolist()
    table_for = lambda n: torch.tensor([free.pop() for _ in range(-(-n // bs))])
    seqs = [table_for(prefix + new), table_for(plain), *[table_for(n) for n in decode_ctx]]
    slot = lambda table, p: int(table[p // bs]) * bs + p % bs
    slots = [slot(seqs[0], p) for p in range(prefix, prefix + new)] + [slot(seqs[1], p) for p in range(plain)] + \
            [slot(t, n - 1) for t, n in zip(seqs[2:], decode_ctx)]
    width = max(len(t) for t in seqs)
    padded = torch.stack([torch.nn.functional.pad(t, (0, width - len(t))) for t in seqs])
    meta = AttentionMetadata(torch.tensor(slots), [new, plain], [prefix + new, plain], [padded[0], padded[1]], padded[2:],
                             torch.tensor(decode_ctx))
    tokens = new + plain + len(decode_ctx)
    q, k, v = (torch.randn(tokens, h, d, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    want_k, want_v = kc.to(dtype).float(), vc.to(dtype).float()
    want = paged_attention(q.float(), k.float(), v.float(), want_k, want_v, meta, d ** -0.5)
    got_k, got_v = kc.to(dtype), vc.to(dtype)
    got = triton_attention.paged_attention(q, k, v, got_k, got_v, meta, d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert torch.equal(got_k.float(), want_k) and torch.equal(got_v.float(), want_v)  # this step's K/V stored at its slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_k_matches_naive(dtype):
    """Split-K at 32 context tokens per program (tables 6 blocks of 16 wide: 3 splits of two blocks):
    contexts shorter than one split (the other splits empty), ending inside and at a split's end, and
    the whole table; GQA 3:1."""
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 16
    gen = torch.Generator().manual_seed(5)
    lens = [1, 20, 32, 33, 95, 96]
    ks, vs, kc, vc, bt, q = decode_case(lens, heads, kv_heads, head_dim, block_size, gen, spare_blocks=2)
    assert bt.shape[1] * block_size // 32 > 1
    out = paged_decode_attention(q.to(dtype), kc.to(dtype), vc.to(dtype), bt, torch.tensor(lens), head_dim ** -0.5, split_tokens=32)
    whole = paged_decode_attention(q.to(dtype), kc.to(dtype), vc.to(dtype), bt, torch.tensor(lens), head_dim ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), whole.float(), atol=tol, rtol=tol)
    for i, n in enumerate(lens):
        ks_i, vs_i = (x.to(dtype).float() for x in (ks[i], vs[i]))
        torch.testing.assert_close(out[i:i + 1].float(), naive(q[i:i + 1].to(dtype).float(), ks_i, vs_i, head_dim ** -0.5, n - 1),
                                   atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="multiple of the block size"):
        paged_decode_attention(q, kc, vc, bt, torch.tensor(lens), 1.0, split_tokens=24)
