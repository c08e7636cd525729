import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels.direct_call import direct_call
from kvpilot.kernels.linear import Linear


@direct_call
class SwiGLU(nn.Module):
    """residual + down(silu(gate(x)) * up(x)); the SiLU, the product and the add ride on the matmuls.
    gelu_tanh: GeGLU (Gemma), gelu(gate(x)) with the tanh approximation instead of the SiLU. Without a
    residual (Gemma's norm comes after the MLP), down(...) alone."""

    def __init__(self, gate: Linear, up: Linear, down: Linear, act: str = "silu"):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.gelu = act == "gelu_tanh"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        gated = F.gelu(self.gate(x), approximate="tanh") if self.gelu else self.gate.silu(x)
        h = self.up.mul(x, gated)
        return self.down(h) if residual is None else self.down.add(h, residual)
