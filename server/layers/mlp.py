import torch
from torch import nn

from kvpilot.kernels.direct_call import direct_call
from kvpilot.kernels.linear import Linear


@direct_call
class SwiGLU(nn.Module):
    """residual + down(silu(gate(x)) * up(x)); the SiLU, the product and the add ride on the matmuls."""

    def __init__(self, gate: Linear, up: Linear, down: Linear):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.down.add(self.up.mul(x, self.gate.silu(x)), residual)
