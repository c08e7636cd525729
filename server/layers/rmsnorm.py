import torch
from torch import nn

from kvpilot.kernels.direct_call import direct_call
from kvpilot.kernels.ops import REFERENCE, Ops


@direct_call
class RMSNorm(nn.Module):
    """x / rms(x) * weight, in float32 (as transformers does), through the dispatch layer's rms_norm."""

    def __init__(self, weight: torch.Tensor, eps: float, ops: Ops = REFERENCE):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)
