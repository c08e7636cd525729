"""Mixture-of-experts FFN: a router picks each token's top-k experts, and each expert's gated MLP runs over
the tokens routed to it. The fused-experts op takes the step's tokens grouped by expert, so that each expert's
weights are read once per step whatever the number of its tokens (a loop over tokens would read them once per
token; a loop over experts with a mask, once per expert but over every token).

Weights, per layer: w13 [experts, 2 * inner, hidden] (each expert's gate rows, then its up rows: one matmul for
both) and w2 [experts, hidden, inner]. Under tensor parallelism each rank holds every expert with a slice of its
inner dimension (as vLLM shards by default), and the outputs are summed over the ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] float32, expert ids [tokens, top_k]): the softmax over the experts in float32, its top k,
    renormalised to sum to 1 where the model does (Mixtral always; Qwen3-MoE by norm_topk_prob)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      act: str = "silu") -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]), expert(x) = down(act(gate(x)) * up(x)), [tokens, hidden] in
    x's dtype (the products by the weights in the weights' dtype). The (token, k) pairs sorted by expert, then one
    matmul pair per expert that has tokens."""
    tokens, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # (on the host: the loop's bounds)
    grouped = x[order // k]
    out = torch.empty(tokens * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        gate, up = (grouped[start:start + n] @ w13[expert].t()).chunk(2, dim=-1)
        gated = (F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate)) * up
        out[order[start:start + n]] = gated @ w2[expert].t()
        start += n
    return (out.view(tokens, k, -1).to(weights.dtype) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
