"""The Triton paged decode attention (kernels/triton_attention.py) against a naive per-sequence
attention over contiguous K/V, under TRITON_INTERPRET=1 on CPU: GQA groups of 1, 3 and 4 (padded to a
power of two inside the kernel), head_dim 64 and 128, block sizes 16 and 32, ragged contexts that end
inside, at and one past a block boundary, float32 and float16."""

import pytest
import torch
from test_paged_attention import naive, paged

from kvpilot.kernels.triton_attention import paged_decode_attention


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 64, 16), (8, 2, 64, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_matches_naive(heads, kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(heads * 10 + block_size)
    lens = [block_size, block_size + 1, 3 * block_size - 1, 1, 70]
    ks = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lens]
    vs = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lens]
    kc, vc, tables = paged(ks, vs, block_size, sum(-(-n // block_size) for n in lens) + 4, gen)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
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
    with pytest.raises(ValueError, match="power-of-two head_dim and block size, not 48 and 16"):
        paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), 1.0)
    with pytest.raises(ValueError, match="not a multiple of 3 KV heads"):
        paged_decode_attention(torch.randn(1, 4, 64), torch.zeros(4, 16, 3, 64), torch.zeros(4, 16, 3, 64),
                               torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), 1.0)
