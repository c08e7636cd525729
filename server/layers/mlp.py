import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.gate_up.T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.down.T
