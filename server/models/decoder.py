"""One decoder for every supported family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) over a paged KV
cache. The families' differences are data in ModelConfig (biases, q/k norms, RoPE scaling); the
weights come by their transformers names from a GGUF file or a checkpoint directory alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels.linear import make_linear
from kvpilot.kernels.ops import ops_for
from kvpilot.kernels.paged_attention import AttentionMetadata
from kvpilot.server.layers.attention import PagedSelfAttention
from kvpilot.server.layers.mlp import SwiGLU
from kvpilot.server.layers.rmsnorm import RMSNorm
from kvpilot.server.layers.rotary import RotaryEmbedding
from kvpilot.server.models.config import ModelConfig, ModelFormatError


class WeightSource(Protocol):
    """A GGUF file or a checkpoint directory, read by transformers tensor names."""

    path: Path
    memory_mapped: bool  # load() returns views of a file mapping (not owned tensors)

    def checkpoint_names(self) -> set[str]: ...

    def load(self, name: str) -> torch.Tensor: ...


class DecoderLayer(nn.Module):
    def __init__(self, attn: PagedSelfAttention, mlp: SwiGLU, attn_norm: RMSNorm, mlp_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp, self.attn_norm, self.mlp_norm = attn, mlp, attn_norm, mlp_norm

    def forward(self, x, rope, kv_cache, meta):
        x = self.attn(self.attn_norm(x), x, rope, kv_cache, meta)
        return self.mlp(self.mlp_norm(x), x)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[DecoderLayer], norm: RMSNorm, lm_head: torch.Tensor | None,
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
    def load(cls, source: WeightSource, config: ModelConfig, dtype: torch.dtype, device: torch.device,
             progress: Callable[[int], None] | None = None) -> DecoderModel:
        c = config
        w = _WeightReader(source, dtype, device, progress)
        ops = ops_for(device)
        norm = lambda name: RMSNorm(w(name), c.rms_norm_eps, ops)
        layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            qkv_bias = torch.cat([w(a + f"{x}_proj.bias") for x in "qkv"]) if c.family.qkv_bias or c.attention_bias else None
            attn = PagedSelfAttention(
                make_linear(torch.cat([w(a + f"{x}_proj.weight") for x in "qkv"]), bias=qkv_bias),
                make_linear(w(a + "o_proj.weight"), bias=w(a + "o_proj.bias") if c.attention_bias else None),
                c.num_heads, c.num_kv_heads, c.head_dim, ops,
                qk_norms=(norm(a + "q_norm.weight"), norm(a + "k_norm.weight")) if c.family.qk_norm else None)
            mlp = SwiGLU(*(make_linear(w(m + f"{x}_proj.weight"), bias=w(m + f"{x}_proj.bias") if c.mlp_bias else None)
                           for x in ("gate", "up", "down")))
            layers.append(DecoderLayer(attn, mlp, norm(p + "input_layernorm.weight"), norm(p + "post_attention_layernorm.weight")))
        embed = w("model.embed_tokens.weight")
        head = None if c.tie_word_embeddings else w("lm_head.weight")
        rotary = RotaryEmbedding(c.head_dim, c.max_position, c.rope_theta, c.rope_scaling).to(device)
        model = cls(c, embed, layers, norm("model.norm.weight"), head, rotary)
        w.check_all_read(ignored={"lm_head.weight"} if c.tie_word_embeddings else set())
        return model


class _WeightReader:
    """Reads weights by name, each cast to the compute dtype and moved to the device as it is read (no
    second full copy of the model in host memory), and keeps count: a weight the model never read
    means a variant this code does not implement, an error rather than a silently different model."""

    def __init__(self, source: WeightSource, dtype: torch.dtype, device: torch.device, progress: Callable[[int], None] | None):
        self.source, self.dtype, self.device, self.progress = source, dtype, device, progress
        self.available = source.checkpoint_names()
        self.read: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.available:
            raise ModelFormatError(f"{self.source.path}: weight {name!r} is missing")
        loaded = self.source.load(name)
        t = loaded.to(device=self.device, dtype=self.dtype).contiguous()
        if self.source.memory_mapped and t.data_ptr() == loaded.data_ptr():
            # An owned copy: a tensor that still shares the checkpoint's mapping would keep the whole
            # file resident (and counted) for as long as the model lives.
            t = t.clone()
        self.read.add(name)
        if self.progress:
            self.progress(1)
        return t

    def check_all_read(self, ignored: set[str]) -> None:
        # A tied checkpoint may also store the head; older ones store RoPE's inverse frequencies.
        unread = sorted(n for n in self.available - self.read - ignored if not n.endswith("rotary_emb.inv_freq"))
        if unread:
            more = f" and {len(unread) - 5} more" if len(unread) > 5 else ""
            raise ModelFormatError(f"{self.source.path}: weights the model does not use (an unsupported variant?): {', '.join(unread[:5])}{more}")


