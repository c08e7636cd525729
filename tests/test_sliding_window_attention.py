"""Sliding-window attention (Gemma 3's local layers, Mistral v0.1): every kernel behind the dispatch layer
— the torch references, the C++ decode and prefill kernels, the Triton ones under TRITON_INTERPRET=1 —
lets the query at position p see keys p − window < k ≤ p only (transformers' sliding_window_overlay),
against a naive attention with that mask; and none of them reads a block wholly before the window:
those blocks' values are NaN here, and any read would reach the output (0 · NaN is NaN)."""

import pytest
import torch
from test_paged_attention import paged

from kvpilot.kernels import cpu_extension, triton_attention
from kvpilot.kernels.ops import REFERENCE, _triton_ops, ops_for
from kvpilot.kernels.paged_attention import AttentionMetadata, decode_attention_grouped, prefill_attention_ref


def naive_window(q, k, v, scale, offset, window):
    """q [n, h, d], k/v [L, kvh, d]; query i at position offset + i sees keys offset + i − window < j ≤ offset + i."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q, k) * scale
    q_pos = (offset + torch.arange(q.shape[0]))[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    s = s.masked_fill(~((k_pos <= q_pos) & (k_pos > q_pos - window))[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def poison_before(cache, table, first_seen, block_size):
    """NaN in every block of `table` that lies wholly before position first_seen."""
    for b in table[:first_seen // block_size]:
        cache[b] = float("nan")


def case(lens, heads, kv_heads, head_dim, block_size, window, new, seed):
    """Sequences of `lens` tokens in a shuffled paged cache, each with its last new[i] tokens as this step's;
    the V blocks before each sequence's earliest window are NaN."""
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lens]
    vs = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lens]
    kc, vc, tables = paged(ks, vs, block_size, sum(-(-n // block_size) for n in lens) + 6, gen)
    for t, n, m in zip(tables, lens, new):
        poison_before(vc, t, max(0, n - m + 1 - window), block_size)
    q = torch.randn(sum(new), heads, head_dim, generator=gen)
    spare = next(b for b in range(kc.shape[0]) if all(b not in t for t in tables))  # zeros: what padded tables point to
    width = max(map(len, tables))
    padded = torch.tensor([t + [spare] * (width - len(t)) for t in tables])
    return ks, vs, kc, vc, tables, padded, q


DECODERS = {"torch": decode_attention_grouped, "cpp": lambda *a, **kw: cpu_extension.require().paged_decode_attention(*a, **kw),
            "triton": triton_attention.paged_decode_attention}


SHAPES = [(4, 1, 256, 16), (8, 2, 64, 16), (6, 3, 128, 32), (4, 2, 80, 5)]  # (Triton: power-of-two head dims and blocks of 16+ only)


@pytest.mark.parametrize("impl,heads,kv_heads,head_dim,block_size",
                         [(impl, *shape) for impl in DECODERS for shape in SHAPES if impl != "triton" or shape[2] != 80])
@pytest.mark.parametrize("window", [40, 200])  # 200: wider than the C++ kernel's 128-key ranges, its first key inside one
def test_decode_sees_only_its_window(impl, heads, kv_heads, head_dim, block_size, window):
    lens = [300, 7, 41, 40, 39, 1, 95, 450, 201]  # far past, inside, at and one past the window
    ks, vs, kc, vc, _, bt, q = case(lens, heads, kv_heads, head_dim, block_size, window, [1] * len(lens), seed=heads + block_size)
    kwargs = {"split_tokens": 4 * block_size} if impl == "triton" else {}  # triton: the split-K form, some splits wholly before the window
    out = DECODERS[impl](q, kc, vc, bt, torch.tensor(lens), head_dim ** -0.5, window=window, **kwargs)
    for i, n in enumerate(lens):
        torch.testing.assert_close(out[i:i + 1], naive_window(q[i:i + 1], ks[i], vs[i], head_dim ** -0.5, n - 1, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "cpp", "triton"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 1, 256, 16), (8, 2, 64, 16), (4, 2, 128, 32)])
@pytest.mark.parametrize("total,new", [(700, 90), (130, 130), (64, 30), (600, 1)])  # over a cached prefix, plain, shorter than the window
def test_prefill_rows_see_only_their_windows(impl, heads, kv_heads, head_dim, block_size, total, new):
    window = 48
    ks, vs, kc, vc, _, (bt,), q = case([total], heads, kv_heads, head_dim, block_size, window, [new], seed=total + new)
    k, v = ks[0][total - new:], vs[0][total - new:]
    if impl == "reference":
        out = prefill_attention_ref(q, k, v, kc, vc, bt, total, head_dim ** -0.5, window=window)
    elif impl == "cpp":
        out = cpu_extension.require().paged_prefill_attention(q, kc, vc, bt, total, head_dim ** -0.5, window=window)
    else:
        out = triton_attention.paged_prefill_attention(q, kc, vc, bt[None], torch.tensor([0]), torch.tensor([new]), torch.tensor([total]),
                                                       head_dim ** -0.5, new, window=window)
    torch.testing.assert_close(out, naive_window(q, ks[0], vs[0], head_dim ** -0.5, total - new, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ops_name", ["reference", "cpu-c++", "triton"])
def test_a_mixed_step_through_the_dispatch_layer(ops_name):
    """One step with prefills (over a prefix, plain, a short tail) and decodes, through ops.paged_attention(window=...)."""
    ops = {"reference": REFERENCE, "cpu-c++": ops_for(torch.device("cpu")), "triton": _triton_ops()}[ops_name]
    assert ops.name == ops_name
    heads, kv_heads, head_dim, bs, window = 4, 1, 64, 16, 33
    lens, new = [200, 50, 120, 90, 3, 34], [70, 50, 4, 1, 1, 1]
    ks, vs, kc, vc, tables, bt, q = case(lens, heads, kv_heads, head_dim, bs, window, new, seed=5)
    slots = torch.tensor([tables[i][p // bs] * bs + p % bs for i, n in enumerate(lens) for p in range(n - new[i], n)])
    k = torch.cat([ks[i][n - new[i]:] for i, n in enumerate(lens)])
    v = torch.cat([vs[i][n - new[i]:] for i, n in enumerate(lens)])
    meta = AttentionMetadata(slots, new[:3], lens[:3], [bt[i] for i in range(3)], bt[3:], torch.tensor(lens[3:]))
    out = ops.paged_attention(q, k, v, kc, vc, meta, head_dim ** -0.5, window=window)
    start = 0
    for i, n in enumerate(lens):
        rows = slice(start, start + new[i])
        torch.testing.assert_close(out[rows], naive_window(q[rows], ks[i], vs[i], head_dim ** -0.5, n - new[i], window), atol=1e-5, rtol=1e-5)
        start += new[i]
