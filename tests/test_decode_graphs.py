"""Decode steps through the static buffers the CUDA graphs replay (server/engine/decode_graphs.py).
Capturing needs a GPU; what CI checks here is everything around it, on the same code path with
capture=False: the buckets, the inputs copied into the buffers, and the padding rows, which write to
the scratch block and never to a live sequence's cache, as the batch shrinks and grows."""

import pytest
import torch

from kvpilot.server.engine.decode_graphs import batch_buckets


def test_buckets_double_up_to_the_largest_batch():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]


@pytest.mark.timeout(300)
def test_static_decode_steps_give_the_plain_steps_tokens():
    """Seven sequences stopping at different lengths: decode batches of 7, 6, … 1 rows, so buckets 8
    and 4 run with padding rows that a previous, larger step left holding live sequences' cache slots.
    Tokens equal the eager steps' exactly; logprobs within the projections' batch-size summation noise."""
    from kvpilot.server import LLM, SamplingParams
    from oracle import ORACLE_PROMPTS

    prompts = ORACLE_PROMPTS[:7]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=1) for i in range(len(prompts))]
    llm = LLM(num_threads=1, show_progress=False, enable_prefix_caching=False, kv_cache_memory="64MiB")
    runner = llm.engine.worker

    def run():
        return [(o.outputs[0].token_ids, [max(e.values()) for e in o.outputs[0].logprobs]) for o in llm.generate(prompts, params)]

    eager = run()
    assert runner.decode_graphs is None  # on CPU the engine never starts them itself
    runner.start_decode_graphs(llm.engine.max_model_len, capture=False)
    graphs = runner.decode_graphs
    assert graphs.buckets == [1, 2, 4, 8, 16, 32, 64] and graphs.table_width == -(-llm.engine.max_model_len // 16)
    rows_seen = []
    plain_run = graphs.run

    def spy(inp):
        rows_seen.append(inp.input_ids.shape[0])
        return plain_run(inp)

    graphs.run = spy
    static = run()
    assert set(rows_seen) == set(range(1, 8))  # every batch size from 7 down, padded to 8, 8, 4, 4, 2, 1 (and 4 for 3)
    assert [t for t, _ in static] == [t for t, _ in eager]
    for (_, lp_static), (_, lp_eager) in zip(static, eager):
        torch.testing.assert_close(torch.tensor(lp_static), torch.tensor(lp_eager), atol=1e-4, rtol=1e-4)
    k_cache = runner.kv_caches[0][0]
    assert k_cache.shape[0] == llm.engine.block_manager.num_blocks + 1 == runner.scratch_block + 1  # the scratch block is never handed out



def test_the_kv_budget_profiles_a_prefill_and_a_graph_wide_decode_step(monkeypatch):
    """A worker's CUDA memory profile (_profile_peaks, _kv_cache_bytes) run on CPU with torch.cuda's
    memory counters stubbed: the throwaway steps it builds (a prefill of max_num_batched_tokens, a
    decode of max_num_seqs rows over graph-wide tables) go through the real model, and the budget
    subtracts what they report (the decode peak only when graphs will be captured)."""
    from kvpilot.server import LLM

    llm = LLM(show_progress=False, num_threads=1, kv_cache_memory="16MiB", max_num_seqs=8, max_num_batched_tokens=64)
    runner = llm.engine.worker
    calls = []
    peaks = iter([1000, 300])  # max_memory_allocated per profiled step (base 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: next(peaks))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (60_000, 100_000))
    plain_forward = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda ids, pos, kv, meta, hidden=None: calls.append((len(ids), meta.decode_block_tables.shape))
                        or plain_forward(ids, pos, kv, meta, hidden=hidden))
    assert runner._profile_peaks() == (1000, 300)
    width = -(-runner.model.config.max_position // 16)
    assert calls == [(64, (0, 0)), (8, (8, width))]
    # As on a GPU (the profile as measured above): 90% of 100,000 bytes, 40,000 in use.
    monkeypatch.setattr(runner, "_profile_peaks", lambda: (1000, 300))
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    explicit = runner.config
    assert runner._kv_cache_bytes() == 16 << 20  # set explicitly: the cache's size on a GPU too (vLLM's --kv-cache-memory-bytes)
    unset = type(explicit).model_construct(_fields_set=explicit.model_fields_set - {"kv_cache_memory"}, **explicit.model_dump())
    monkeypatch.setattr(runner, "config", unset)  # unset: the share of the GPU below
    assert runner._why_no_graphs() == "the cpu-c++ kernels are not capturable (they read device values on the host)"
    assert runner._kv_cache_bytes() == 90_000 - 40_000 - 1000  # no graphs with these kernels: no decode reserve
    monkeypatch.setattr(runner, "_why_no_graphs", lambda: None)
    assert runner._kv_cache_bytes() == 90_000 - 40_000 - 1000 - 300
