"""RoPE (the in-place C++ pass over a fused QKV output, alone and with the cache store) and RMSNorm against torch formulas."""

import pytest
import torch

from kvpilot.kernels import cpu_extension
from kvpilot.kernels.ops import REFERENCE, ops_for
from kvpilot.server.layers.rotary import RotaryEmbedding

CPU = ops_for(torch.device("cpu"))


def rotate_(rope: RotaryEmbedding, qkv, positions, heads, kv_heads, store=None, ops=CPU) -> bool:
    return ops.rotary_qkv_(qkv, rope.rope(positions, qkv.dtype), heads, kv_heads, rope.head_dim, store)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float32: the C++ pass; others: the torch path
@pytest.mark.parametrize("heads,kv_heads,d,tokens", [(9, 3, 64, 1), (9, 3, 64, 37), (4, 4, 32, 5)])
def test_rotary_on_fused_qkv_matches_torch_formula(dtype, heads, kv_heads, d, tokens):
    cpu_extension.require()  # fails loudly if the kernel cannot be built: the engine would silently fall back
    assert CPU.name == "cpu-c++"
    rope = RotaryEmbedding(d, 2048, 10000.0)
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen, dtype=dtype)
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    want = qkv.clone()
    for first, n in ((0, heads), (heads, kv_heads)):
        cols = slice(first * d, (first + n) * d)
        want[:, cols] = rope(positions, qkv[:, cols].reshape(tokens, n, d)).reshape(tokens, n * d)
    got = qkv.clone()
    assert not rotate_(rope, got, positions, heads, kv_heads)  # nothing to store
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    ref = qkv.clone()
    assert not rotate_(rope, ref, positions, heads, kv_heads, ops=REFERENCE)
    torch.testing.assert_close(ref, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(got[:, (heads + kv_heads) * d:], qkv[:, (heads + kv_heads) * d:])  # V untouched


def test_cpp_rotary_rejects_out_of_range_positions():
    rope = RotaryEmbedding(16, 8, 10000.0)
    with pytest.raises(RuntimeError, match="position out of range"):
        rotate_(rope, torch.zeros(1, 48), torch.tensor([8]), 1, 1)


@pytest.mark.parametrize("tokens", [1, 16, 37])
def test_rotary_and_cache_store_in_one_pass_equals_rotate_then_write(tokens):
    from kvpilot.kernels.paged_attention import write_kv

    heads, kv_heads, d, block_size, blocks = 9, 3, 64, 16, 8
    rope = RotaryEmbedding(d, 2048, 10000.0)
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    caches = [torch.randn(blocks, block_size, kv_heads, d, generator=gen) for _ in range(2)]
    want_qkv, want_k, want_v = qkv.clone(), caches[0].clone(), caches[1].clone()
    rotate_(rope, want_qkv, positions, heads, kv_heads)
    _, k, v = want_qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    write_kv(want_k, want_v, k.reshape(tokens, kv_heads, d), v.reshape(tokens, kv_heads, d), slots)
    got_qkv, got_k, got_v = qkv.clone(), caches[0].clone(), caches[1].clone()
    assert rotate_(rope, got_qkv, positions, heads, kv_heads, (got_k, got_v, slots))
    assert torch.equal(got_qkv, want_qkv) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        rotate_(rope, qkv.clone(), positions, heads, kv_heads, (got_k, got_v, slots + blocks * block_size))
    # A bfloat16 cache under float32 compute (kv_cache_dtype): the same one pass, values rounded as write_kv's conversion rounds them.
    want_k16, want_v16 = caches[0].bfloat16(), caches[1].bfloat16()
    write_kv(want_k16, want_v16, k.reshape(tokens, kv_heads, d), v.reshape(tokens, kv_heads, d), slots)
    got_qkv, got_k16, got_v16 = qkv.clone(), caches[0].bfloat16(), caches[1].bfloat16()
    assert rotate_(rope, got_qkv, positions, heads, kv_heads, (got_k16, got_v16, slots))
    assert torch.equal(got_qkv, want_qkv) and torch.equal(got_k16, want_k16) and torch.equal(got_v16, want_v16)
    assert not rotate_(rope, qkv.clone(), positions, heads, kv_heads, (got_k.half(), got_v.half(), slots))  # float16 cache: caller writes


@pytest.mark.parametrize("rows,width", [(1, 576), (16, 576), (300, 576), (5, 37)])
def test_cpp_rms_norm_matches_the_formula(rows, width):
    from kvpilot.server.layers.rmsnorm import RMSNorm

    cpu_extension.require()
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, width, generator=gen) * 3, torch.randn(width, generator=gen)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(RMSNorm(w, 1e-5, CPU)(x), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(RMSNorm(w, 1e-5, REFERENCE)(x), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows,width", [(1, 576), (16, 576), (5, 37)])
def test_cpp_rms_norm_of_bfloat16_rows_rounds_as_transformers_does(rows, width):
    """bfloat16 rows: the normalized row rounded to bfloat16, then times the weight (transformers'
    `weight * hidden.to(dtype)`): equal to the reference but where the two sums of squares differ in
    their last bit and a value sits on a rounding boundary."""
    from kvpilot.kernels.ops import rms_norm_ref
    from kvpilot.server.layers.rmsnorm import RMSNorm

    ext = cpu_extension.require()
    assert CPU.name == "cpu-c++"
    gen = torch.Generator().manual_seed(rows)
    x, w = (torch.randn(rows, width, generator=gen) * 3).bfloat16(), torch.randn(width, generator=gen).bfloat16()
    want = rms_norm_ref(x, w, 1e-5)
    for got in (ext.rms_norm(x, w, 1e-5), RMSNorm(w, 1e-5, CPU)(x)):  # the kernel, and the layer through the dispatch table
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)
        assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("rows,width", [(1, 640), (16, 640), (5, 37)])
def test_cpp_rms_norm_with_a_float32_weight_rounds_once_as_gemma_does(rows, width):
    """bfloat16 rows with a float32 weight (Gemma's 1 + w): transformers' Gemma3RMSNorm multiplies the float32
    normalised row by the float32 weight and rounds the product once — no rounding of the row first, which
    would put a weight of 1 + a small w on the row rounded twice."""
    from kvpilot.kernels.ops import rms_norm_ref
    from kvpilot.server.layers.rmsnorm import RMSNorm

    ext = cpu_extension.require()
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=gen) * 3).bfloat16()
    w = 1.0 + (torch.randn(width, generator=gen) * 1e-3).bfloat16().float()  # 1 + w: not a bfloat16 value
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w).bfloat16()  # transformers' Gemma3RMSNorm
    twice = rms_norm_ref(x, w.bfloat16(), 1e-6)  # the weight rounded to bfloat16 and the row rounded first
    assert (twice != want).float().mean() > 0.1  # (so the check below can tell the two apart)
    for got in (rms_norm_ref(x, w, 1e-6), ext.rms_norm(x, w, 1e-6), RMSNorm(w, 1e-6, CPU)(x)):
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)
        assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("tokens", [1, 37])
def test_cpp_rotary_of_bfloat16_rows_equals_the_bfloat16_formula(tokens):
    """bfloat16 rows (a bfloat16 model): every product and sum rounded to bfloat16 as the torch formula's
    ops round them — bit-equal to the reference, alone and with the store into a bfloat16 cache."""
    from kvpilot.kernels.paged_attention import write_kv

    cpu_extension.require()
    heads, kv_heads, d, block_size, blocks = 9, 3, 64, 16, 8
    rope = RotaryEmbedding(d, 2048, 10000.0)
    gen = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 4).bfloat16()
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    want = qkv.clone()
    assert not rotate_(rope, want, positions, heads, kv_heads, ops=REFERENCE)
    got = qkv.clone()
    assert not rotate_(rope, got, positions, heads, kv_heads)
    assert torch.equal(got, want) and not torch.equal(got, qkv)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    want_k, want_v = (torch.zeros(blocks, block_size, kv_heads, d, dtype=torch.bfloat16) for _ in range(2))
    _, k, v = want.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    write_kv(want_k, want_v, k.reshape(tokens, kv_heads, d), v.reshape(tokens, kv_heads, d), slots)
    got, got_k, got_v = qkv.clone(), torch.zeros_like(want_k), torch.zeros_like(want_v)
    assert rotate_(rope, got, positions, heads, kv_heads, (got_k, got_v, slots))
    assert torch.equal(got, want) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    # a float32 cache under bfloat16 rows: rotated here, written by the caller
    assert not rotate_(rope, qkv.clone(), positions, heads, kv_heads, (got_k.float(), got_v.float(), slots))
