import torch
from torch import nn

from kvpilot.kernels import cpu_extension


class RotaryEmbedding(nn.Module):
    """RoPE in the half-split layout (pairs are (i, i + d/2)), cos/sin precomputed per position.

    One instance is shared by every layer; the cos/sin rows of a step's positions are gathered once
    and reused by all layers (they see the same positions tensor)."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_position, d/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._step is None or self._step[0] is not positions:
            self._step = (positions, self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype))
        return self._step[1], self._step[2]

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, d] rotated by each token's position."""
        cos, sin = self._rows(positions, x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def rotate_qkv_(self, qkv: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> bool:
        """Rotate, in place, the query and key heads of each row of a fused QKV projection output
        [T, (heads + 2 * kv_heads) * d]. With store = (k_cache, v_cache, slots), on CPU float32 with
        the C++ kernels, each row's K and V are also written to its cache slot in the same pass.
        Returns whether they were (if not, the caller writes them)."""
        rot_heads = num_heads + num_kv_heads
        ext = cpu_extension.load() if qkv.device.type == "cpu" and qkv.dtype == torch.float32 else None
        if ext is not None and store is not None and store[0].dtype == torch.float32:
            ext.rotary_store_kv(qkv, positions, self.cos, self.sin, num_heads, num_kv_heads, self.head_dim, *store)
            return True
        if ext is not None:
            ext.rotary_inplace(qkv, positions, self.cos, self.sin, rot_heads, self.head_dim)
            return False
        x = qkv[:, :rot_heads * self.head_dim].view(qkv.shape[0], rot_heads, self.head_dim)
        x.copy_(self(positions, x))
        return False
