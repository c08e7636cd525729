"""The Triton RMSNorm and RoPE-with-K/V-store kernels (kernels/triton_layers.py) against the torch
references, under TRITON_INTERPRET=1 on CPU: a row width that is not a power of two, GQA heads,
one and many tokens, the cache store at scattered slots, float32 and float16."""

import pytest
import torch

from kvpilot.kernels.ops import REFERENCE
from kvpilot.kernels.paged_attention import write_kv
from kvpilot.kernels.triton_layers import rms_norm, rotary_qkv_
from kvpilot.server.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 576), (1, 64), (2, 3, 96)])
def test_rms_norm_matches_the_reference(dtype, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=gen).to(dtype)
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got, REFERENCE.rms_norm(x, w, 1e-5), atol=tol, rtol=tol)


def test_rms_norm_with_a_float32_weight_rounds_once():
    """float16 rows with a float32 weight (Gemma's 1 + w): the product rounded once, as the reference (and
    transformers' Gemma3RMSNorm) does, not the row first. (Not bfloat16 here: the interpreter's float32 ->
    bfloat16 conversion truncates where a GPU's rounds to nearest, so no bfloat16 output equals the reference.)"""
    dtype = torch.float16
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 640, generator=gen) * 3).to(dtype)
    w = 1.0 + torch.randn(640, generator=gen) * 1e-3
    got, want = rms_norm(x, w, 1e-6), REFERENCE.rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and (got == want).float().mean() > 0.99
    torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)
    assert (REFERENCE.rms_norm(x, w.to(dtype), 1e-6) != want).float().mean() > 0.1  # rounding first differs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d,tokens", [(9, 3, 64, 1), (9, 3, 64, 21), (8, 2, 128, 4)])
@pytest.mark.parametrize("store", [False, True])
def test_rotary_and_cache_store_match_the_reference(dtype, heads, kv_heads, d, tokens, store):
    rope_table = RotaryEmbedding(d, 2048, 10000.0)
    gen = torch.Generator().manual_seed(tokens * d + heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    rope = rope_table.rope(positions, dtype)
    caches = lambda: (torch.zeros(8, 16, kv_heads, d, dtype=dtype), torch.zeros(8, 16, kv_heads, d, dtype=dtype))
    slots = torch.randperm(8 * 16, generator=gen)[:tokens]

    want = qkv.clone()
    REFERENCE.rotary_qkv_(want, rope, heads, kv_heads, d)
    want_k, want_v = caches()
    q_cols, k_cols = heads * d, (heads + kv_heads) * d
    write_kv(want_k, want_v, want[:, q_cols:k_cols].view(tokens, kv_heads, d), want[:, k_cols:].view(tokens, kv_heads, d), slots)

    got = qkv.clone()
    got_k, got_v = caches()
    assert rotary_qkv_(got, rope, heads, kv_heads, d, (got_k, got_v, slots) if store else None) == store
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if store:
        torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)
        assert torch.equal(got_v, want_v)  # V is copied, not computed
    else:
        assert not got_k.any() and not got_v.any()


def test_rotary_refuses_what_it_cannot_take():
    rope = RotaryEmbedding(48, 64, 10000.0).rope(torch.zeros(1, dtype=torch.long), torch.float32)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        rotary_qkv_(torch.zeros(1, 4 * 48), rope, 2, 1, 48)
