"""Mixture-of-experts FFN: a router picks each token's top-k experts, and each expert's gated MLP runs over
the tokens routed to it. The fused-experts op takes the step's tokens grouped by expert, so that each expert's
weights are read once per step whatever the number of its tokens (a loop over tokens would read them once per
token; a loop over experts with a mask, once per expert but over every token).

Weights, per layer (Experts): w13 [experts, 2 * inner, hidden] (each expert's gate rows, then its up rows: one matmul
for both) and w2 [experts, hidden, inner]; or, quantized, each projection's per-expert panels of GGUF-style blocks
(ExpertPanels: the C++ kernel runs them with gguf_linear_panel's instruction sets), or stacked in GGUFWeight's row layout
(ExpertBlocks: the Triton kernel's, gate and up rows fused per expert). Under tensor parallelism each rank holds every expert with a slice of its
inner dimension (as vLLM shards by default), and the outputs are summed over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpilot.kernels.quantized import LAYOUTS, PANEL, GGUFWeight, gguf_isa, to_panels


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


@dataclass(frozen=True)
class ExpertPanels:
    """One projection's experts in gguf_linear_panel's panels (quantized.to_panels of each), stacked on a leading
    dimension: qs, d, m [experts, ...]; out_features rows each."""

    kind: str  # the experts' GGUFWeight kind (one for all)
    out_features: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @classmethod
    def of(cls, experts: list[GGUFWeight]) -> ExpertPanels:
        kinds = {w.kind for w in experts}
        if len(kinds) != 1:
            raise ValueError(f"one projection's experts in one block format, not {sorted(kinds)}")
        panels = [to_panels(w) for w in experts]
        stack = lambda i: None if panels[0][i] is None else torch.stack([p[i] for p in panels])  # noqa: E731
        return cls(experts[0].kind, experts[0].shape[0], stack(0), stack(1), stack(2))

    @property
    def kernel_kind(self) -> int:
        return LAYOUTS[self.kind].kernel_kind

    def dequantize(self) -> torch.Tensor:
        """float32 [experts, out_features, in_features]: each lane of each panel read back as its row (the reference's)."""
        rows = torch.arange(self.out_features, device=self.qs.device)
        p, lane = rows // PANEL, rows % PANEL
        pick = lambda t, e: None if t is None else t[e][p, ..., lane].reshape(self.out_features, -1)  # noqa: E731
        return torch.stack([GGUFWeight(self.kind, pick(self.qs, e), pick(self.d, e), pick(self.m, e)).dequantize()
                            for e in range(self.qs.shape[0])])


@dataclass(frozen=True)
class ExpertBlocks:
    """One projection's experts in GGUFWeight's row layout (the Triton kernels'), stacked on a leading dimension: qs, d,
    m [experts, ...] as one GGUFWeight holds them for out_features rows."""

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @classmethod
    def of(cls, experts: list[GGUFWeight]) -> ExpertBlocks | None:
        """The experts stacked, or None where they cannot be: kinds or shapes that differ, permuted columns (act order),
        activation quantization."""
        first = experts[0]
        if any(w.kind != first.kind or w.shape != first.shape or w.perm is not None or w.act is not None for w in experts):
            return None
        stack = lambda part: None if getattr(first, part) is None else torch.stack([getattr(w, part) for w in experts])  # noqa: E731
        return cls(first.kind, stack("qs"), stack("d"), stack("m"))

    def expert(self, e: int) -> GGUFWeight:
        return GGUFWeight(self.kind, self.qs[e], self.d[e], None if self.m is None else self.m[e])

    def dequantize(self) -> torch.Tensor:
        """float32 [experts, out_features, in_features]."""
        return torch.stack([self.expert(e).dequantize() for e in range(self.qs.shape[0])])


@dataclass(frozen=True)
class Experts:
    """A layer's experts (this rank's share of each one's inner dimension): dense w13 [experts, 2 * inner, hidden] and
    w2 [experts, hidden, inner] in the compute dtype, or quantized: each projection's panels (the C++ op's), or w13's and
    w2's blocks (the Triton kernel's; w13's rows as the dense one's, gate then up)."""

    inner: int
    w13: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    panels: tuple[ExpertPanels, ExpertPanels, ExpertPanels] | None = None  # gate, up, down
    blocks: tuple[ExpertBlocks, ExpertBlocks] | None = None  # w13, w2

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as the reference takes them (quantized ones dequantized: slow, for comparisons)."""
        if self.panels is not None:
            gate, up, down = (p.dequantize().to(dtype) for p in self.panels)
            return torch.cat([gate, up], dim=1), down
        if self.blocks is not None:
            return tuple(b.dequantize().to(dtype) for b in self.blocks)
        return self.w13, self.w2


def fused_experts_reference(x: torch.Tensor, experts: Experts, weights: torch.Tensor, ids: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The dispatch layer's reference: fused_experts_ref on the experts' dense (or dequantized) matrices."""
    return fused_experts_ref(x, *experts.dense(x.dtype), weights, ids, act)


def fused_experts_cpu(ext, x: torch.Tensor, experts: Experts, weights: torch.Tensor, ids: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The C++ kernels (kernels/csrc/moe_cpu.cpp): panels for quantized experts, ATen matmuls for float32 / bfloat16 ones
    (others: the reference). The weights multiply in float32."""
    gelu, ids, weights = act == "gelu_tanh", ids.contiguous(), weights.float().contiguous()
    if experts.panels is not None:
        gate, up, down = experts.panels
        out = ext.fused_experts_panel(x.float().contiguous(), weights, ids, gate.qs, gate.d, gate.m, gate.kernel_kind, up.qs, up.d, up.m,
                                      up.kernel_kind, down.qs, down.d, down.m, down.kernel_kind, experts.inner, gelu, gguf_isa())
        return out.to(x.dtype)
    if x.dtype in (torch.float32, torch.bfloat16) and experts.w13.dtype == x.dtype:
        return ext.fused_experts_dense(x.contiguous(), experts.w13, experts.w2, weights, ids, gelu)
    return fused_experts_reference(x, experts, weights, ids, act)
