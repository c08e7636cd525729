import torch
from torch import nn

from kvpilot.kernels.direct_call import direct_call
from kvpilot.kernels.fused_moe import ExpertBlocks, ExpertPanels, Experts, route
from kvpilot.kernels.ops import Ops


@direct_call
class SparseMoE(nn.Module):
    """residual + the token's top-k experts' gated MLPs, weighted by the router (kernels/fused_moe.py). The router is
    replicated on every rank; under tensor parallelism each rank's experts hold a slice of their inner dimension and
    the outputs are summed (`tp_group`). weights_dtype: the dtype the expert outputs are weighted in (Qwen3-MoE: the
    compute dtype, as transformers casts the weights; Mixtral: float32, as transformers keeps them). shared: Qwen2-MoE's
    shared expert (a gated MLP without its residual: this rank's slice of it under tensor parallelism) and the gate whose
    sigmoid scales its output, added to the routed experts' before the sum over ranks."""

    def __init__(self, router: nn.Module, experts: Experts, top_k: int, renormalize: bool, ops: Ops, act: str = "silu",
                 weights_dtype: torch.dtype | None = None, tp_group=None, tp_rank: int = 0, sharded: bool = False,
                 shared: tuple[nn.Module, nn.Module] | None = None):
        super().__init__()
        self.router = router
        self.shared_expert, self.shared_expert_gate = shared or (None, None)
        self.inner = experts.inner
        if experts.panels is not None:
            self.kinds = tuple((p.kind, p.out_features) for p in experts.panels)
            for name, p in zip(("gate", "up", "down"), experts.panels):
                for part in ("qs", "d", "m"):
                    self.register_buffer(f"{name}_{part}", getattr(p, part), persistent=False)
        elif experts.blocks is not None:
            self.block_kinds = tuple(b.kind for b in experts.blocks)
            for name, b in zip(("w13", "w2"), experts.blocks):
                for part in ("qs", "d", "m"):
                    self.register_buffer(f"{name}_{part}", getattr(b, part), persistent=False)
        else:
            self.register_buffer("w13", experts.w13, persistent=False)
            self.register_buffer("w2", experts.w2, persistent=False)
        self.top_k, self.renormalize, self.ops, self.act, self.weights_dtype = top_k, renormalize, ops, act, weights_dtype
        self.sharded, self.tp_group, self.tp_rank = sharded, tp_group, tp_rank
        self._bind()

    def _bind(self) -> None:
        # The experts as one plain attribute (rebuilt when .to() and friends replace the buffers).
        if hasattr(self, "kinds"):
            panels = tuple(ExpertPanels(kind, out, *(getattr(self, f"{name}_{part}") for part in ("qs", "d", "m")))
                           for name, (kind, out) in zip(("gate", "up", "down"), self.kinds))
            self.experts = Experts(self.inner, panels=panels)
        elif hasattr(self, "block_kinds"):
            blocks = tuple(ExpertBlocks(kind, *(getattr(self, f"{name}_{part}") for part in ("qs", "d", "m")))
                           for name, kind in zip(("w13", "w2"), self.block_kinds))
            self.experts = Experts(self.inner, blocks=blocks)
        else:
            self.experts = Experts(self.inner, self.w13, self.w2)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._bind()
        return self

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        weights, ids = route(self.router(x), self.top_k, self.renormalize)
        out = self.ops.fused_experts(x, self.experts, weights.to(self.weights_dtype or x.dtype), ids, self.act)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, None)
        if self.sharded:
            import torch.distributed as dist

            if residual is not None and self.tp_rank == 0:  # counted once in the sum
                out = out + residual
            dist.all_reduce(out, group=self.tp_group)
            return out
        return out if residual is None else out + residual
