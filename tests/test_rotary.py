"""RoPE: the in-place C++ pass over a fused QKV output against the torch formula."""

import pytest
import torch

from kvpilot.kernels import cpu_extension
from kvpilot.server.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float32: the C++ pass; others: the torch path
@pytest.mark.parametrize("heads,kv_heads,d,tokens", [(9, 3, 64, 1), (9, 3, 64, 37), (4, 4, 32, 5)])
def test_rotary_on_fused_qkv_matches_torch_formula(dtype, heads, kv_heads, d, tokens):
    cpu_extension.require()  # fails loudly if the kernel cannot be built: the engine would silently fall back
    rope = RotaryEmbedding(d, 2048, 10000.0)
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen, dtype=dtype)
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    want = qkv.clone()
    for first, n in ((0, heads), (heads, kv_heads)):
        cols = slice(first * d, (first + n) * d)
        want[:, cols] = rope(positions, qkv[:, cols].reshape(tokens, n, d)).reshape(tokens, n * d)
    got = qkv.clone()
    rope.rotate_qkv_(got, positions, heads + kv_heads)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(got[:, (heads + kv_heads) * d:], qkv[:, (heads + kv_heads) * d:])  # V untouched


def test_cpp_rotary_rejects_out_of_range_positions():
    rope = RotaryEmbedding(16, 8, 10000.0)
    with pytest.raises(RuntimeError, match="position out of range"):
        rope.rotate_qkv_(torch.zeros(1, 48), torch.tensor([8]), 2)
