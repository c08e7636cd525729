import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """RoPE in the half-split layout (pairs are (i, i + d/2)), cos/sin precomputed per position."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_position, d/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, d] rotated by each token's position."""
        cos = self.cos[positions][:, None, :].to(x.dtype)
        sin = self.sin[positions][:, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
