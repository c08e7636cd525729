"""Tensor parallelism on the other families' test checkpoints (its own module: one tensor-parallel
engine per process, and test_tensor_parallel.py keeps one alive for its whole module)."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_two_ranks_on_each_family_equal_one(family_checkpoints, family):
    """Checkpoints of the other families over 2 ranks: Qwen2's q/k/v biases split with their heads,
    Llama 3's and Qwen3's single KV head replicated on both ranks (Qwen3 with its q/k norms); greedy
    ids equal one rank's, prompt logprobs within 1e-4."""
    from kvpilot.server import LLM, SamplingParams

    directory, _ = family_checkpoints[family]
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8, 13,"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    results = []
    for world in (1, 2):
        llm = LLM(model=str(directory), num_threads=1, show_progress=False, kv_cache_memory="16MiB", tensor_parallel_size=world)
        results.append(llm.generate(prompts, greedy))
        if world == 2:
            assert [r["kv_heads"] for r in llm.engine.runner.describe_ranks()] == [llm.engine.model_config.num_kv_heads // 2 or 1] * 2
        llm.engine.close()
    one, two = results
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    for a, b in zip(one, two):
        assert max(abs(x[t] - y[t]) for x, y, t in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], a.prompt_token_ids[1:])) < 1e-4
