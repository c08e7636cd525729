import torch
from torch import nn

from kvpilot.kernels.linear import LinearWeight, linear, linear_add
from kvpilot.kernels.paged_attention import AttentionMetadata, paged_attention
from kvpilot.server.layers.rotary import RotaryEmbedding


class PagedSelfAttention(nn.Module):
    """GQA self-attention whose K/V live in the paged cache (fused QKV projection; the output
    projection adds the residual)."""

    def __init__(self, qkv: torch.Tensor, o: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding):
        super().__init__()
        self.qkv, self.o = LinearWeight.create(qkv), LinearWeight.create(o)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary = rotary
        self.scale = head_dim ** -0.5

    def forward(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = linear(x, self.qkv)
        stored = self.rotary.rotate_qkv_(qkv, positions, self.num_heads, self.num_kv_heads, (*kv_cache, meta.slot_mapping))
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, kv_stored=stored)
        return linear_add(out.reshape(t, q_size), self.o, residual)
