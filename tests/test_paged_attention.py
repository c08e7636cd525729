"""Paged attention (CPU path) against a naive per-sequence attention over contiguous K/V."""

import sys

import pytest
import torch

from kvpilot.kernels import cpu_extension
from kvpilot.kernels.paged_attention import HUGE_PAGE, AttentionMetadata, decode_attention_grouped, kv_cache_zeros, paged_attention, prefill_attention_ref


def cpp_decode(*args):
    """The C++ kernel; require() fails loudly when it cannot be built (the engine would only warn)."""
    return cpu_extension.require().paged_decode_attention(*args)


DECODERS = {"cpp": cpp_decode, "torch": decode_attention_grouped}


def cpp_prefill(*args):
    return cpu_extension.require().paged_prefill_attention(*args)


def decode_case(lens, heads, kv_heads, head_dim, block_size, gen, spare_blocks):
    """Random contiguous K/V per sequence (`lens` tokens each), scattered into a shuffled paged cache:
    (ks, vs, k_cache, v_cache, padded block tables, one query per sequence)."""
    ks = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lens]
    vs = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lens]
    kc, vc, tables = paged(ks, vs, block_size, sum(-(-n // block_size) for n in lens) + spare_blocks, gen)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return ks, vs, kc, vc, bt, torch.randn(len(lens), heads, head_dim, generator=gen)


def naive(q, k, v, scale, offset):
    """q [n, h, d], k/v [L, kvh, d]; query i sits at position offset + i (causal)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q, k) * scale
    L = k.shape[0]
    mask = torch.arange(L)[None, :] <= (offset + torch.arange(q.shape[0]))[:, None]
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def paged(k_seq, v_seq, block_size, num_blocks, gen):
    """Scatter contiguous per-sequence K/V into a shuffled paged cache; returns caches and tables."""
    kvh, d = k_seq[0].shape[1:]
    kc, vc = torch.zeros(num_blocks, block_size, kvh, d), torch.zeros(num_blocks, block_size, kvh, d)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for k, v in zip(k_seq, v_seq):
        blocks = [free.pop() for _ in range(-(-k.shape[0] // block_size))]
        for p in range(k.shape[0]):
            kc[blocks[p // block_size], p % block_size] = k[p]
            vc[blocks[p // block_size], p % block_size] = v[p]
        tables.append(blocks)
    return kc, vc, tables


@pytest.mark.parametrize("impl", DECODERS)
@pytest.mark.parametrize("batch", [11, 1])  # C++: work items are (sequence, KV head), dealt to threads by length
# head_dim 64 and 128 take the C++ kernel's AVX-512 path (16-token score blocks with a ragged tail): query groups of 1-4 heads
# (64; 1-2 at 128) walking K and V once together, larger ones head by head; the other head_dims its generic one
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 64, 16), (8, 4, 64, 16), (8, 2, 64, 16),
                                                                 (10, 2, 64, 16), (4, 2, 128, 16), (8, 2, 128, 16), (4, 4, 32, 1),
                                                                 (8, 2, 80, 5), (6, 1, 16, 32), (3, 1, 7, 3)])
def test_decode_matches_naive(impl, batch, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(heads * 100 + block_size + batch)
    lens = torch.randint(1, 90, (batch,), generator=gen).tolist()  # ragged, more than one decode group
    lens[0] = 300  # many blocks: the next-block prefetch, several full 16-token score blocks
    ks, vs, kc, vc, bt, q = decode_case(lens, heads, kv_heads, head_dim, block_size, gen, spare_blocks=20)
    out = DECODERS[impl](q, kc, vc, bt, torch.tensor(lens), head_dim ** -0.5)
    for i, n in enumerate(lens):
        ref = naive(q[i:i + 1], ks[i], vs[i], head_dim ** -0.5, n - 1)
        torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("total", "new", "cache_dtype"), [
    (23, 9, torch.float32),    # 14 cached tokens (3 whole blocks and part of one), 9 new ones
    (17, 1, torch.float32),    # one new token (no mask) after 4 whole blocks
    (24, 8, torch.float32),    # a block-aligned prefix
    (23, 9, torch.bfloat16),   # a bfloat16 cache under float32 compute: the prefix widened as it is read
])
def test_prefill_with_cached_prefix_and_write_path(total, new, cache_dtype):
    gen = torch.Generator().manual_seed(7)
    heads, kvh, d, bs = 6, 2, 32, 4
    k, v = torch.randn(total, kvh, d, generator=gen), torch.randn(total, kvh, d, generator=gen)
    if cache_dtype != torch.float32:  # what the cache holds is what the prefix attends to
        k[: total - new], v[: total - new] = k[: total - new].to(cache_dtype).float(), v[: total - new].to(cache_dtype).float()
    kc, vc, (table,) = paged([k[: total - new]], [v[: total - new]], bs, 50, gen)
    kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    table += [b for b in range(50) if b not in table][: -(-total // bs) - len(table)]
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(total - new, total)])
    q = torch.randn(new, heads, d, generator=gen)
    meta = AttentionMetadata(slots, [new], [total], [torch.tensor(table)], torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    out = paged_attention(q, k[total - new:], v[total - new:], kc, vc, meta, d ** -0.5)
    torch.testing.assert_close(out, naive(q, k, v, d ** -0.5, total - new), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prefill_attention_ref(q, k[total - new:], v[total - new:], kc, vc, torch.tensor(table), total, d ** -0.5), out)


def test_prefill_without_prefix_uses_new_kv_and_fills_cache():
    gen = torch.Generator().manual_seed(3)
    heads, kvh, d, bs, n = 4, 2, 16, 4, 10
    k, v, q = torch.randn(n, kvh, d, generator=gen), torch.randn(n, kvh, d, generator=gen), torch.randn(n, heads, d, generator=gen)
    kc, vc = torch.zeros(8, bs, kvh, d), torch.zeros(8, bs, kvh, d)
    table = [5, 2, 7]
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
    meta = AttentionMetadata(slots, [n], [n], [torch.tensor(table)], torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    out = paged_attention(q, k, v, kc, vc, meta, d ** -0.5)
    torch.testing.assert_close(out, naive(q, k, v, d ** -0.5, 0), atol=1e-5, rtol=1e-5)
    assert torch.equal(kc.view(-1, kvh, d)[slots], k) and torch.equal(vc.view(-1, kvh, d)[slots], v)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_cpp_decode_reads_a_bfloat16_cache(head_dim):
    gen = torch.Generator().manual_seed(5)
    lens = [1, 17, 40]
    ks = [torch.randn(n, 2, head_dim, generator=gen).bfloat16() for n in lens]
    vs = [torch.randn(n, 2, head_dim, generator=gen).bfloat16() for n in lens]
    kc, vc, tables = paged([k.float() for k in ks], [v.float() for v in vs], 8, 12, gen)
    bt = torch.tensor([t + [0] * (5 - len(t)) for t in tables])
    q = torch.randn(3, 6, head_dim, generator=gen)
    out = cpp_decode(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), bt, torch.tensor(lens), head_dim ** -0.5)
    assert out.dtype == torch.bfloat16
    for i, n in enumerate(lens):
        ref = naive(q[i:i + 1].bfloat16().float(), ks[i].float(), vs[i].float(), head_dim ** -0.5, n - 1)
        torch.testing.assert_close(out[i:i + 1].float(), ref, atol=2e-2, rtol=2e-2)


def test_dispatch_table_ops_agree_on_a_mixed_step():
    """The CPU table (C++ decode kernel) and the reference table give the same attention for a step
    with a prefill over a cached prefix and several decodes, through the one op name layers call."""
    from kvpilot.kernels.ops import REFERENCE, ops_for

    cpu = ops_for(torch.device("cpu"))
    assert cpu.name == "cpu-c++" and REFERENCE.name == "reference"
    gen = torch.Generator().manual_seed(11)
    heads, kvh, d, bs = 6, 2, 64, 16
    lens = [40, 7, 23, 64]  # sequence 0 prefills its last 9 tokens; the others decode one each
    ks = [torch.randn(n, kvh, d, generator=gen) for n in lens]
    vs = [torch.randn(n, kvh, d, generator=gen) for n in lens]
    kc, vc, tables = paged(ks, vs, bs, 40, gen)
    new = [9, 1, 1, 1]
    slots = torch.tensor([tables[i][p // bs] * bs + p % bs for i, n in enumerate(lens) for p in range(n - new[i], n)])
    k = torch.cat([ks[i][n - new[i]:] for i, n in enumerate(lens)])
    v = torch.cat([vs[i][n - new[i]:] for i, n in enumerate(lens)])
    q = torch.randn(len(k), heads, d, generator=gen)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    meta = AttentionMetadata(slots, [9], [40], [bt[0]], bt[1:], torch.tensor(lens[1:]))
    outs = [ops.paged_attention(q, k, v, kc.clone(), vc.clone(), meta, d ** -0.5) for ops in (cpu, REFERENCE)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0][:9], naive(q[:9], ks[0], vs[0], d ** -0.5, 31), atol=1e-5, rtol=1e-5)


def test_cpp_decode_on_two_threads_equals_one_thread():
    """Work items are claimed by the threads as they go (kernels/csrc/work_queue.h): on two threads
    every (sequence, KV head) is still computed exactly once, by the same arithmetic."""
    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 200, (13,), generator=gen).tolist()
    ks, vs, kc, vc, bt, q = decode_case(lens, 9, 3, 64, 16, gen, spare_blocks=4)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(cpp_decode(q, kc, vc, bt, torch.tensor(lens), 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    for i, n in enumerate(lens):
        torch.testing.assert_close(outs[1][i:i + 1], naive(q[i:i + 1], ks[i], vs[i], 0.125, n - 1), atol=1e-5, rtol=1e-5)


# The C++ prefill kernel: a KV head's query rows (every new token's heads of its group) over ranges of at most
# 512 keys (blocks of 5: 510), merged per row. head_dim 64 and 128 take its register-tiled AVX-512 path on an
# AVX-512 host (tiles of 1-4 rows at 64, 1-2 at 128), the others its row-tiled generic one.
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 8), (8, 2, 80, 5), (3, 1, 7, 3)])
@pytest.mark.parametrize("new,prefix", [(1, 1300), (9, 1100), (37, 0), (6, 2)])
def test_cpp_prefill_matches_naive_and_each_row_is_computed_alone(heads, kv_heads, head_dim, block_size, new, prefix):
    gen = torch.Generator().manual_seed(heads * 1000 + new + prefix)
    total = prefix + new
    k, v = torch.randn(total, kv_heads, head_dim, generator=gen), torch.randn(total, kv_heads, head_dim, generator=gen)
    kc, vc, (table,) = paged([k], [v], block_size, -(-total // block_size) + 7, gen)
    q = torch.randn(new, heads, head_dim, generator=gen)
    out = cpp_prefill(q, kc, vc, torch.tensor(table), total, head_dim ** -0.5)
    torch.testing.assert_close(out, naive(q, k, v, head_dim ** -0.5, prefix), atol=1e-5, rtol=1e-5)
    # A row's arithmetic does not depend on the rows beside it: the last token alone (a prefix hit's one-token
    # tail) gives its row bit for bit, so a cached prompt's first token repeats the uncached one's.
    assert torch.equal(cpp_prefill(q[-1:], kc, vc, torch.tensor(table), total, head_dim ** -0.5), out[-1:])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cpp_prefill_reads_bfloat16_and_fp8_caches(cache_dtype):
    gen = torch.Generator().manual_seed(9)
    heads, kvh, d, bs, new, total = 9, 3, 64, 16, 7, 700
    scales = (0.5, 2.0) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    k, v = torch.randn(total, kvh, d, generator=gen), torch.randn(total, kvh, d, generator=gen)
    kc, vc, (table,) = paged([k], [v], bs, 50, gen)
    kc, vc = (kc / scales[0]).to(cache_dtype), (vc / scales[1]).to(cache_dtype)
    q = torch.randn(new, heads, d, generator=gen)
    out = cpp_prefill(q, kc, vc, torch.tensor(table), total, d ** -0.5, *scales)
    held = lambda c, s: c.float().view(-1, kvh, d)[[table[p // bs] * bs + p % bs for p in range(total)]] * s  # noqa: E731
    torch.testing.assert_close(out, naive(q, held(kc, scales[0]), held(vc, scales[1]), d ** -0.5, total - new), atol=1e-5, rtol=1e-5)


def test_cpp_prefill_refuses_a_context_past_its_block_table():
    gen = torch.Generator().manual_seed(1)
    kc = vc = torch.randn(4, 16, 1, 64, generator=gen)
    with pytest.raises(RuntimeError, match="context longer than its block table"):
        cpp_prefill(torch.randn(2, 1, 64, generator=gen), kc, vc, torch.tensor([0, 1]), 40, 0.125)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(sys.platform != "linux", reason="transparent huge pages are Linux's (elsewhere the cache is a plain tensor)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_kv_cache_is_zeroed_and_advised_onto_huge_pages(dtype):
    shape = (601, 16, 3, 64)  # 3.5 MiB in bfloat16: past one huge page, not a whole number of them
    cache = kv_cache_zeros(shape, dtype, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.any()
    assert cache.data_ptr() % HUGE_PAGE == 0  # the advice covers whole huge pages from its first byte
    assert "hg" in _vm_flags(cache.data_ptr())  # MADV_HUGEPAGE took (the flag is set whatever the THP mode)
    small = kv_cache_zeros((2, 16, 3, 64), dtype, torch.device("cpu"))  # under a huge page: a plain tensor
    assert small.shape == (2, 16, 3, 64) and not small.any()
