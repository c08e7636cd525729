import torch
from torch import nn

from kvpilot.kernels.linear import LinearWeight, linear_add, linear_mul, linear_silu


class SwiGLU(nn.Module):
    """residual + down(silu(gate(x)) * up(x)); the SiLU, the product and the add ride on the matmuls."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate, self.up, self.down = LinearWeight.create(gate), LinearWeight.create(up), LinearWeight.create(down)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return linear_add(linear_mul(x, self.up, linear_silu(x, self.gate)), self.down, residual)
