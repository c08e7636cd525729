import torch
from torch import nn

from kvpilot.kernels.ops import Rope, apply_rope


class RotaryEmbedding(nn.Module):
    """RoPE tables in the half-split layout (pairs are (i, i + d/2)), cos/sin precomputed per position.
    rope(positions, dtype) is computed once per forward pass and handed to every layer."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_position, d/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return Rope(positions, self.cos, self.sin, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, d] rotated by each token's position (the formula, for references and tests)."""
        r = self.rope(positions, x.dtype)
        return apply_rope(x, r.cos, r.sin)
