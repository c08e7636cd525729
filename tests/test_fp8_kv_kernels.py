"""The FP8 KV cache's kernels (kv_cache_dtype fp8): every writer stores the bytes torch's own
conversion makes of K / k_scale and V / v_scale, and every reader equals attention over the cache's
dequantized values — the C++ RoPE + store and decode attention, the torch prefill path after a cached
prefix, and the Triton store, decode (whole and split-K) and prefill kernels under TRITON_INTERPRET=1."""

from itertools import accumulate

import pytest
import torch
from test_paged_attention import decode_case, naive, paged

from kvpilot.kernels import cpu_extension, triton_attention
from kvpilot.kernels.ops import REFERENCE, ops_for
from kvpilot.kernels.paged_attention import FP8_KV, FP8_MAX, decode_attention_grouped, dequantize, prefill_attention_ref, quantize_fp8, write_kv
from kvpilot.kernels.triton_layers import rotary_qkv_ as triton_rotary_qkv_
from kvpilot.server.layers.rotary import RotaryEmbedding

SCALES = (0.0625, 0.25)  # k_scale, v_scale: values past 448 * scale saturate, small ones go subnormal


def fp8_cache(cache: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 cache, its dequantized float32 values)."""
    q = quantize_fp8(cache, scale)
    return q, dequantize(q, scale, torch.float32)


def test_quantize_saturates_and_rounds_like_torch():
    x = torch.tensor([1000.0, -1000.0, 448.0 * 0.0625, 1e-6, -0.0, 3.3])
    q = quantize_fp8(x, 0.0625)
    assert q.dtype == FP8_KV
    assert q.float().tolist()[:2] == [FP8_MAX, -FP8_MAX]  # saturated, never NaN (e4m3fn has no infinity)
    assert torch.equal(q.view(torch.uint8), (x / 0.0625).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV).view(torch.uint8))
    assert not q.float().isnan().any()


@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("store_ops", ["cpu", "triton"])
def test_rope_and_store_write_the_bytes_torch_makes(tokens, store_ops):
    heads, kv_heads, d, block_size, blocks = 9, 3, 64, 16, 8
    if store_ops == "cpu":
        cpu_extension.require()
        rotary = ops_for(torch.device("cpu")).rotary_qkv_
    else:
        rotary = triton_rotary_qkv_
    rope_table = RotaryEmbedding(d, 2048, 10000.0)
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 40  # some past 448 * k_scale
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    rope = rope_table.rope(positions, torch.float32)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    empty = lambda: (torch.zeros(blocks, block_size, kv_heads, d, dtype=FP8_KV), torch.zeros(blocks, block_size, kv_heads, d, dtype=FP8_KV))
    want = qkv.clone()
    REFERENCE.rotary_qkv_(want, rope, heads, kv_heads, d)
    want_k, want_v = empty()
    q_cols, k_cols = heads * d, (heads + kv_heads) * d
    write_kv(want_k, want_v, want[:, q_cols:k_cols].reshape(tokens, kv_heads, d), want[:, k_cols:].reshape(tokens, kv_heads, d), slots, SCALES)
    got = qkv.clone()
    got_k, got_v = empty()
    assert rotary(got, rope, heads, kv_heads, d, (got_k, got_v, slots), SCALES)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8)) and torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    assert want_k.view(torch.uint8).any() and (want_k.float().abs() == FP8_MAX).any()  # stored, some saturated


@pytest.mark.parametrize("decode", ["cpp", "torch", "triton", "triton-split"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 32)])
def test_decode_over_an_fp8_cache_is_attention_over_its_values(decode, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(heads + head_dim)
    lens = [1, block_size, block_size + 1, 70, 3 * block_size - 1]
    _, _, kc, vc, bt, q = decode_case(lens, heads, kv_heads, head_dim, block_size, gen, spare_blocks=3)
    (kq, kf), (vq, vf) = fp8_cache(kc * 4, SCALES[0]), fp8_cache(vc, SCALES[1])
    args = (q, kq, vq, bt, torch.tensor(lens), head_dim ** -0.5)
    if decode == "cpp":
        out = cpu_extension.require().paged_decode_attention(*args, *SCALES)
    elif decode == "torch":
        out = decode_attention_grouped(*args, SCALES)
    else:
        out = triton_attention.paged_decode_attention(*args, SCALES, **({"split_tokens": 32} if decode == "triton-split" else {}))
    want = decode_attention_grouped(q, kf, vf, bt, torch.tensor(lens), head_dim ** -0.5)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_prefill_after_an_fp8_prefix_is_attention_over_its_values(impl):
    """Chunks after cached prefixes (ending inside and at a block boundary) and a plain prefill: both
    attend over the values the cache holds (the torch path reads the prefix from it and rounds the new
    tokens' K/V as stored; the Triton kernel reads every key from it), so a prefix hit reads back exactly
    what the step that computed the prefix used."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(3)
    contexts, new = [3 * block_size, 2 * block_size + 5, 20], [block_size + 3, 4, 20]
    ks = [torch.randn(n, kv_heads, head_dim, generator=gen) * 4 for n in contexts]
    vs = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in contexts]
    kc, vc, tables = paged(ks, vs, block_size, sum(-(-n // block_size) for n in contexts) + 2, gen)
    (kq, kf), (vq, vf) = fp8_cache(kc, SCALES[0]), fp8_cache(vc, SCALES[1])
    q = torch.randn(sum(new), heads, head_dim, generator=gen)
    starts = list(accumulate(new[:-1], initial=0))
    scale = head_dim ** -0.5
    if impl == "triton":
        width = max(map(len, tables))
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        out = triton_attention.paged_prefill_attention(q, kq, vq, bt, torch.tensor(starts), torch.tensor(new), torch.tensor(contexts),
                                                       scale, max(new), SCALES)
    for i, (ctx, n) in enumerate(zip(contexts, new)):
        rows = slice(starts[i], starts[i] + n)
        table = torch.tensor(tables[i])
        k_new, v_new = ks[i][ctx - n:], vs[i][ctx - n:]
        got = prefill_attention_ref(q[rows], k_new, v_new, kq, vq, table, ctx, scale, SCALES) if impl == "torch" else out[rows]
        want = naive(q[rows], kf[table].flatten(0, 1)[:ctx], vf[table].flatten(0, 1)[:ctx], scale, ctx - n)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("decode", ["cpp", "triton"])
def test_decode_widens_every_fp8_byte_exactly(decode):
    """Each of e4m3fn's 254 finite codes (subnormals, ±0, ±448) as a value row that is its sequence's
    whole context: the output is that row times v_scale, bit for bit, so the kernels' own widening (the
    C++ one 8 bytes at a time through float16 fields, the Triton one in integer arithmetic) is torch's."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[~codes.view(FP8_KV).float().isnan()]
    heads, kv_heads, head_dim, block_size = 3, 1, 64, 16
    seqs = -(-codes.numel() // head_dim)
    cache = torch.zeros(seqs, block_size, kv_heads, head_dim, dtype=torch.uint8)
    rows = torch.zeros(seqs * head_dim, dtype=torch.uint8)
    rows[:codes.numel()] = codes
    cache[:, 0, 0] = rows.view(seqs, head_dim)  # sequence b's one token: codes 64b .. 64b + 63
    kq, vq = cache.view(FP8_KV), cache.flip(-1).contiguous().view(FP8_KV)
    bt, lens = torch.arange(seqs).view(-1, 1), torch.ones(seqs, dtype=torch.long)
    q = torch.randn(seqs, heads, head_dim, generator=torch.Generator().manual_seed(0))
    out = (cpu_extension.require().paged_decode_attention(q, kq, vq, bt, lens, 0.125, *SCALES) if decode == "cpp"
           else triton_attention.paged_decode_attention(q, kq, vq, bt, lens, 0.125, SCALES))
    want = (vq[:, 0].float() * SCALES[1]).expand(seqs, heads, head_dim)
    assert torch.equal(out, want)
