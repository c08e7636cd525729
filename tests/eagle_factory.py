"""EAGLE-3 heads for tests: random weights in the published layout (server/models/eagle.py), written as
a head directory (config.json + model.safetensors) for a target ModelConfig."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def write_eagle3_head(dest: Path, target, draft_ids: list[int] | None = None, seed: int = 0, hidden_size: int | None = None,
                      vocab_size: int | None = None, aux_layers: list[int] | None = None, with_embedding: bool = False) -> Path:
    """draft_ids: the target ids of the draft vocabulary (default: the whole vocabulary); hidden_size /
    vocab_size: the head's own (default the target's: a mismatch is what a wrong head looks like)."""
    g = torch.Generator().manual_seed(seed)
    h = hidden_size or target.hidden_size
    vocab = vocab_size or target.vocab_size
    draft = sorted(draft_ids) if draft_ids is not None else list(range(vocab))
    heads, kv, d, inter = target.num_heads, target.num_kv_heads, target.head_dim, target.intermediate_size
    rand = lambda *shape: torch.randn(*shape, generator=g) * shape[-1] ** -0.5  # noqa: E731
    m = "midlayer."
    tensors = {"fc.weight": rand(h, 3 * target.hidden_size),
               m + "input_layernorm.weight": torch.ones(h), m + "hidden_norm.weight": torch.ones(h),
               m + "self_attn.q_proj.weight": rand(heads * d, 2 * h), m + "self_attn.k_proj.weight": rand(kv * d, 2 * h),
               m + "self_attn.v_proj.weight": rand(kv * d, 2 * h), m + "self_attn.o_proj.weight": rand(h, heads * d),
               m + "post_attention_layernorm.weight": torch.ones(h),
               m + "mlp.gate_proj.weight": rand(inter, h), m + "mlp.up_proj.weight": rand(inter, h), m + "mlp.down_proj.weight": rand(h, inter),
               "norm.weight": torch.ones(h), "lm_head.weight": rand(len(draft), h),
               "d2t": torch.tensor(draft, dtype=torch.long) - torch.arange(len(draft)),
               "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(draft), True)}
    if with_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, h)
    dest.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, str(dest / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h, "intermediate_size": inter,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d, "num_hidden_layers": 1, "hidden_act": "silu",
              "rms_norm_eps": target.rms_norm_eps, "vocab_size": vocab, "draft_vocab_size": len(draft), "rope_theta": target.rope_theta,
              "max_position_embeddings": target.max_position, "target_hidden_size": target.hidden_size, "tie_word_embeddings": False}
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers, "use_aux_hidden_state": True}
    (dest / "config.json").write_text(json.dumps(config))
    return dest
