import torch
from torch import nn

from kvpilot.kernels.direct_call import direct_call
from kvpilot.kernels.linear import Linear
from kvpilot.kernels.ops import Ops
from kvpilot.kernels.paged_attention import NO_SCALES, AttentionMetadata, write_kv
from kvpilot.kernels.rope import Rope
from kvpilot.server.layers.rmsnorm import RMSNorm


@direct_call
class PagedSelfAttention(nn.Module):
    """GQA self-attention whose K/V live in the paged cache (fused QKV projection; the output
    projection adds the residual when one is given). qk_norms: per-head RMSNorms of queries and keys,
    applied before RoPE (Qwen3, Gemma 3). window: a sliding-window layer's window in tokens (0: global);
    scale: the scores' scale (default head_dim ** -0.5)."""

    def __init__(self, qkv: Linear, o: Linear, num_heads: int, num_kv_heads: int, head_dim: int, ops: Ops,
                 qk_norms: tuple[RMSNorm, RMSNorm] | None = None, window: int = 0, scale: float | None = None):
        super().__init__()
        self.qkv, self.o = qkv, o
        self.q_norm, self.k_norm = qk_norms or (None, None)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.ops = ops
        self.window = window
        self.scale = head_dim ** -0.5 if scale is None else scale
        # An FP8 KV cache's (k_scale, v_scale) for this layer, set by the worker (Worker.set_kv_scales).
        self.kv_scales = NO_SCALES

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv(x)
        if self.q_norm is not None:
            q, k = qkv[:, :q_size + kv_size].split([q_size, kv_size], dim=-1)
            q.copy_(self.q_norm(q.reshape(-1, self.head_dim)).view(t, q_size))
            k.copy_(self.k_norm(k.reshape(-1, self.head_dim)).view(t, kv_size))
        return qkv

    def store(self, x: torch.Tensor, rope: Rope, kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor) -> None:
        """Only the rows' K/V, rotated and written to the cache (rows whose attention output no one reads)."""
        t, q_size, kv_size = x.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self._qkv(x)
        if not self.ops.rotary_qkv_(qkv, rope, self.num_heads, self.num_kv_heads, self.head_dim, (*kv_cache, slot_mapping), self.kv_scales):
            _, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            write_kv(*kv_cache, k.reshape(t, self.num_kv_heads, self.head_dim), v.reshape(t, self.num_kv_heads, self.head_dim), slot_mapping,
                     self.kv_scales)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self._qkv(x)
        stored = self.ops.rotary_qkv_(qkv, rope, self.num_heads, self.num_kv_heads, self.head_dim, (*kv_cache, meta.slot_mapping), self.kv_scales)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = self.ops.paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, kv_stored=stored, kv_scales=self.kv_scales,
                                       window=self.window)
        return self.o(out.reshape(t, q_size)) if residual is None else self.o.add(out.reshape(t, q_size), residual)
