import math

import torch
from torch import nn

from kvpilot.kernels.rope import Rope, apply_rope
from kvpilot.server.model_config import RopeScaling


def inverse_frequencies(head_dim: int, base: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """RoPE's per-pair rotation speeds [d/2] in float32, with the model's frequency scaling applied."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "factors":
        if len(scaling.freq_factors) != head_dim // 2:
            raise ValueError(f"RoPE frequency factors: {len(scaling.freq_factors)} given, {head_dim // 2} needed")
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    # llama3: wavelengths longer than original_max_position / low_freq_factor are slowed by `factor`,
    # those shorter than original_max_position / high_freq_factor kept; in between, a linear blend.
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > scaling.original_max_position / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    blend = (scaling.original_max_position / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * slowed / scaling.factor + blend * slowed
    in_band = (wavelength >= scaling.original_max_position / scaling.high_freq_factor) & (wavelength <= scaling.original_max_position / scaling.low_freq_factor)
    return torch.where(in_band, blended, slowed)


class RotaryEmbedding(nn.Module):
    """RoPE tables in the half-split layout (pairs are (i, i + d/2)), cos/sin precomputed per position.
    rope(positions, dtype) is computed once per forward pass and handed to every layer."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: RopeScaling | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(head_dim, base, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_position, d/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return Rope(positions, self.cos, self.sin, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, d] rotated by each token's position (the formula, for references and tests)."""
        r = self.rope(positions, x.dtype)
        return apply_rope(x, r.cos, r.sin)
