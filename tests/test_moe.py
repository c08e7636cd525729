"""Mixtures of experts (kernels/fused_moe.py, server/layers/moe.py): the router's top-k and renormalisation as
transformers does them, the fused-experts op against a token-by-token loop for skewed routings, and the tiny
Qwen3-MoE and Mixtral checkpoints (tests/checkpoint_factory.py) in prefill chunks and with prefix hits, greedy equal to
transformers (one at a time, batched, GGUF and tensor parallelism: test_model_families.py, test_tensor_parallel_families.py)."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels.fused_moe import fused_experts_ref, route


def per_token(x, w13, w2, weights, ids, act="silu"):
    """Each token through its experts one by one: the definition the op must equal."""
    out = torch.zeros_like(x, dtype=torch.float64)
    inner = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            gate, up = h[:inner], h[inner:]
            gated = (torch.nn.functional.gelu(gate, approximate="tanh") if act == "gelu_tanh" else torch.nn.functional.silu(gate)) * up
            out[t] += float(weights[t, j]) * (w2[e].double() @ gated)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("routing", ["random", "all_to_one", "one_unused"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_fused_experts_equals_each_token_through_its_experts(routing, act):
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inner, experts, k = 13, 48, 24, 6, 2
    x = torch.randn(tokens, hidden, generator=gen)
    w13, w2 = torch.randn(experts, 2 * inner, hidden, generator=gen) / 7, torch.randn(experts, hidden, inner, generator=gen) / 5
    weights, ids = route(torch.randn(tokens, experts, generator=gen), k, renormalize=True)
    if routing == "all_to_one":  # every token's both slots on expert 3 (its weights read once, for 26 rows)
        ids = torch.full_like(ids, 3)
    elif routing == "one_unused":  # no token for expert 0
        ids = torch.where(ids == 0, torch.ones_like(ids), ids)
    got = fused_experts_ref(x, w13, w2, weights, ids, act)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), per_token(x, w13, w2, weights, ids, act), atol=1e-4)


def test_route_takes_the_top_k_of_the_float32_softmax_renormalised_where_the_model_does():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]], dtype=torch.bfloat16)
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits.float(), -1)
    assert weights.dtype == torch.float32 and ids.tolist() == [[0, 1], [2, 3]]
    assert torch.equal(weights, torch.stack([probs[0, [0, 1]], probs[1, [2, 3]]]))
    renormalised, same = route(logits, 2, renormalize=True)
    assert torch.equal(same, ids) and torch.allclose(renormalised.sum(-1), torch.ones(2)) and torch.allclose(renormalised, weights / weights.sum(-1, keepdim=True))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_moe_checkpoints_in_prefill_chunks_and_with_prefix_hits_equal_transformers(family_checkpoints, family):
    """16-token prefill chunks (a step's tokens routed apart from the next step's), then the same prompts again from the
    prefix cache: greedy ids equal transformers' by the family tests' rule."""
    from test_model_families import CheckpointOracle, greedy, llm

    from oracle import compare_greedy

    directory, _ = family_checkpoints[family]
    oracle = CheckpointOracle(directory).run()
    engine = llm(directory, max_num_batched_tokens=16)
    assert engine.engine.model_config.num_experts == 8 and engine.engine.model_config.is_moe(0)
    for run in ("chunked", "prefix hits"):
        hits = engine.engine.block_manager.prefix_hits
        _, tokens, topk = greedy(engine, batched=True)
        result = compare_greedy(tokens, topk, oracle)
        assert result["exact"] >= result["total"] - 1 and not result["violations"], (run, result)
    full_blocks = sum((len(r.prompt_ids) - 1) // 16 * 16 for r in oracle)  # every prompt's full blocks but its last token's
    assert full_blocks >= 32 and engine.engine.block_manager.prefix_hits - hits == full_blocks
