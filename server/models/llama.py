"""The Llama family (Llama 2/3, SmolLM, Qwen-less GQA models) over a paged KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels.linear import make_linear
from kvpilot.kernels.ops import ops_for
from kvpilot.kernels.paged_attention import AttentionMetadata
from kvpilot.server.gguf_loader import GGUFFile, LlamaConfig, unpermute_rope_rows
from kvpilot.server.layers.attention import PagedSelfAttention
from kvpilot.server.layers.mlp import SwiGLU
from kvpilot.server.layers.rmsnorm import RMSNorm
from kvpilot.server.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, attn: PagedSelfAttention, mlp: SwiGLU, attn_norm: RMSNorm, mlp_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp, self.attn_norm, self.mlp_norm = attn, mlp, attn_norm, mlp_norm

    def forward(self, x, rope, kv_cache, meta):
        x = self.attn(self.attn_norm(x), x, rope, kv_cache, meta)
        return self.mlp(self.mlp_norm(x), x)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, embed: torch.Tensor, layers: list[DecoderLayer], norm: RMSNorm, lm_head: torch.Tensor | None,
                 rotary: RotaryEmbedding):
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary = rotary
        # A tied head is the embedding matrix; on CPU it is packed for the matmul (a second copy,
        # 113 MB for SmolLM2, repaid by a 3x faster head on every decode step).
        self.lm_head = make_linear(embed if lm_head is None else lm_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)
        rope = self.rotary.rope(positions, x.dtype)  # once per forward, shared by every layer
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, rope, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, dtype: torch.dtype, device: torch.device, progress: Callable[[int], None] | None = None) -> LlamaModel:
        c = gguf.llama_config()

        def w(name: str) -> torch.Tensor:
            t = gguf.tensor(name, dtype=torch.float32)
            if progress:
                progress(1)
            return t

        def to(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        ops = ops_for(device)
        rotary = RotaryEmbedding(c.head_dim, c.max_position, c.rope_theta).to(device)
        layers = []
        for i in range(c.num_layers):
            p = f"blk.{i}."
            q = unpermute_rope_rows(w(p + "attn_q.weight"), c.num_heads)
            k = unpermute_rope_rows(w(p + "attn_k.weight"), c.num_kv_heads)
            attn = PagedSelfAttention(make_linear(to(torch.cat([q, k, w(p + "attn_v.weight")]))), make_linear(to(w(p + "attn_output.weight"))),
                                      c.num_heads, c.num_kv_heads, c.head_dim, ops)
            mlp = SwiGLU(*(make_linear(to(w(p + f"ffn_{name}.weight"))) for name in ("gate", "up", "down")))
            layers.append(DecoderLayer(attn, mlp, RMSNorm(to(w(p + "attn_norm.weight")), c.rms_norm_eps, ops),
                                       RMSNorm(to(w(p + "ffn_norm.weight")), c.rms_norm_eps, ops)))
        embed = to(w("token_embd.weight"))
        head = None if c.tie_word_embeddings else to(w("output.weight"))
        return cls(c, embed, layers, RMSNorm(to(w("output_norm.weight")), c.rms_norm_eps, ops), head, rotary)

