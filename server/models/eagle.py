"""EAGLE-3 draft heads: one decoder layer that drafts from the target's own hidden states.

The published layout (as vLLM loads it: vllm/model_executor/models/llama_eagle3.py at commit
00bd1493b3e8, `Eagle3LlamaForCausalLM` and its `LlamaDecoderLayer` / `LlamaModel`): a directory with
a Llama-style `config.json` (architectures `LlamaForCausalLMEagle3`, `num_hidden_layers` 1,
`draft_vocab_size`, optionally `target_hidden_size`, `norm_before_residual` and the target layers
whose hidden states it reads, `eagle_aux_hidden_state_layer_ids`, top level or in `eagle_config`) and
safetensors holding

    fc.weight                      [H, 3·T]   the three target hidden states (T wide each) -> H
    midlayer.input_layernorm       [H]        on the token's embedding
    midlayer.hidden_norm           [H]        on the hidden state
    midlayer.self_attn.{q,k,v}_proj [heads·d, 2H]  over [embedding; hidden state]
    midlayer.self_attn.o_proj      [H, heads·d]
    midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj
    norm.weight                    [H]
    lm_head.weight                 [draft_vocab, H]
    d2t                            [draft_vocab] int64: target id = draft id + d2t[draft id]
    t2d                            [vocab] bool (not needed to draft: ignored, as vLLM does)
    embed_tokens.weight            [vocab, H] (optional: the target's embedding otherwise)

A row at position p takes the target's hidden state at p and the token at p + 1 and predicts the token
at p + 2; fed its own pre-norm output as the next hidden state, it drafts further. The target's hidden
states are the residual stream entering its layers `aux_layers` (vLLM's numbering; default 2, L/2, L-3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvpilot.kernels.linear import make_linear
from kvpilot.kernels.ops import ops_for
from kvpilot.kernels.paged_attention import AttentionMetadata
from kvpilot.kernels.quantized import embedding, quantize_int8
from kvpilot.server.layers.attention import PagedSelfAttention
from kvpilot.server.layers.mlp import SwiGLU
from kvpilot.server.layers.rmsnorm import RMSNorm
from kvpilot.server.layers.rotary import RotaryEmbedding
from kvpilot.server.model_config import ModelConfig, ModelFormatError, attention_heads, rope_scaling_from_hf

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True, slots=True)
class HeadConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    aux_layers: tuple[int, int, int]
    norm_before_residual: bool
    rotary: tuple[float, object]   # (theta, RopeScaling | None)


def read_head_config(directory: Path, target: ModelConfig) -> HeadConfig:
    """The head's config.json, checked against the target: refused by name when it cannot draft for it."""
    path = directory / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{directory}: no readable config.json ({e})") from None
    where = f"EAGLE-3 head {directory}"
    if hf.get("architectures") != [ARCHITECTURE]:
        raise ModelFormatError(f"{where}: architectures {hf.get('architectures')!r} is not [{ARCHITECTURE!r}] (the EAGLE-3 layout)")

    def need(key: str):
        if hf.get(key) is None:
            raise ModelFormatError(f"{where}: config.json has no {key!r}")
        return hf[key]

    if need("num_hidden_layers") != 1:
        raise ModelFormatError(f"{where}: num_hidden_layers={hf['num_hidden_layers']} (EAGLE-3 heads have one layer)")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ModelFormatError(f"{where}: only silu, bias-free heads are implemented")
    eagle = hf.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise ModelFormatError(f"{where}: use_aux_hidden_state=false (an EAGLE-1 style head) is not implemented")
    hidden = need("hidden_size")
    heads, kv_heads, head_dim = attention_heads(where, hidden, need("num_attention_heads"), hf.get("num_key_value_heads"), hf.get("head_dim"))
    vocab = need("vocab_size")
    if vocab != target.vocab_size:
        raise ModelFormatError(f"{where}: vocab_size {vocab} is not the target's {target.vocab_size}")
    target_hidden = hf.get("target_hidden_size") or hidden
    if target_hidden != target.hidden_size:
        raise ModelFormatError(f"{where}: its target hidden size is {target_hidden}, the target's is {target.hidden_size}")
    layers = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    aux = tuple(layers) if layers else (2, target.num_layers // 2, target.num_layers - 3)
    if len(aux) != 3 or not all(isinstance(i, int) and 0 <= i < target.num_layers for i in aux):
        raise ModelFormatError(f"{where}: eagle_aux_hidden_state_layer_ids {list(aux)} must be three of the target's layers 0..{target.num_layers - 1}")
    if len(set(aux)) != 3:  # the target gives each layer's state once: a repeated id would leave the head's fc a state short
        raise ModelFormatError(f"{where}: eagle_aux_hidden_state_layer_ids {list(aux)} names a layer twice (three different layers are read)")
    rope = hf.get("rope_parameters") or {}
    return HeadConfig(hidden, target_hidden, need("intermediate_size"), heads, kv_heads, head_dim, vocab,
                      hf.get("draft_vocab_size") or vocab, float(need("rms_norm_eps")), aux,
                      bool(hf.get("norm_before_residual", False)),
                      (float(rope.get("rope_theta") or hf.get("rope_theta") or target.rope_theta),
                       rope_scaling_from_hf(rope or hf.get("rope_scaling"), str(path))))


def head_tensor_shapes(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the layout and its shape (embed_tokens.weight and t2d are optional)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    m = "midlayer."
    return {"fc.weight": (c.hidden_size, 3 * c.target_hidden_size),
            m + "input_layernorm.weight": (c.hidden_size,), m + "hidden_norm.weight": (c.hidden_size,),
            m + "self_attn.q_proj.weight": (q, 2 * c.hidden_size), m + "self_attn.k_proj.weight": (kv, 2 * c.hidden_size),
            m + "self_attn.v_proj.weight": (kv, 2 * c.hidden_size), m + "self_attn.o_proj.weight": (c.hidden_size, q),
            m + "post_attention_layernorm.weight": (c.hidden_size,),
            m + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size), m + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            m + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            "norm.weight": (c.hidden_size,), "lm_head.weight": (c.draft_vocab_size, c.hidden_size),
            "d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,), "embed_tokens.weight": (c.vocab_size, c.hidden_size)}


OPTIONAL = {"embed_tokens.weight", "t2d"}


class Eagle3Head(nn.Module):
    """forward(ids, positions, hidden, kv, meta) -> (normed, prenorm): `hidden` is fc(target states)
    or the head's own previous prenorm output; normed goes to `logits`, prenorm back in as `hidden`."""

    def __init__(self, config: HeadConfig, tensors: dict[str, torch.Tensor], target_embed, device: torch.device, dtype: torch.dtype,
                 max_position: int, int8: bool = False):
        """int8: the projections quantized to int8 blocks (quantize_int8: Q8_0's layout and kernels)."""
        super().__init__()
        c, ops = config, ops_for(device)
        self.config = c
        t = lambda name: tensors[name].to(device=device, dtype=dtype).contiguous()  # noqa: E731
        norm = lambda name: RMSNorm(t(name), c.rms_norm_eps, ops)  # noqa: E731
        make = (lambda w: make_linear(quantize_int8(w))) if int8 else make_linear  # noqa: E731
        m = "midlayer."
        self.fc = make(t("fc.weight"))
        self.embed_norm, self.hidden_norm = norm(m + "input_layernorm.weight"), norm(m + "hidden_norm.weight")
        qkv = torch.cat([t(m + f"self_attn.{p}_proj.weight") for p in "qkv"])
        self.attn = PagedSelfAttention(make(qkv), make(t(m + "self_attn.o_proj.weight")), c.num_heads, c.num_kv_heads, c.head_dim, ops)
        self.mlp_norm = norm(m + "post_attention_layernorm.weight")
        self.mlp = SwiGLU(*(make(t(m + f"mlp.{p}_proj.weight")) for p in ("gate", "up", "down")))
        self.norm = norm("norm.weight")
        self.lm_head = make(t("lm_head.weight"))
        self.embed = t("embed_tokens.weight") if "embed_tokens.weight" in tensors else target_embed
        # Where each draft-vocabulary logit lands among the target's ids.
        self.register_buffer("draft_to_target", torch.arange(c.draft_vocab_size, device=device) + tensors["d2t"].to(device=device, dtype=torch.long))
        self.rotary = RotaryEmbedding(c.head_dim, max_position, *c.rotary).to(device)

    def _inputs(self, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's input [embedding; hidden state], the residual)."""
        e = self.embed_norm(embedding(ids, self.embed).to(hidden.dtype))
        if self.config.norm_before_residual:
            hidden = residual = self.hidden_norm(hidden)
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        return torch.cat([e, hidden], dim=-1), residual

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self._inputs(ids, hidden)
        x = self.attn(x, residual, self.rotary.rope(positions, hidden.dtype), kv_cache, meta)
        prenorm = self.mlp(self.mlp_norm(x), x)
        return self.norm(prenorm), prenorm

    def store_kv(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 slot_mapping: torch.Tensor) -> None:
        """Only the rows' K/V into the head's cache (forward's first part: rows no draft starts from)."""
        x, _ = self._inputs(ids, hidden)
        self.attn.store(x, self.rotary.rope(positions, hidden.dtype), kv_cache, slot_mapping)

    def draft_argmax(self, normed: torch.Tensor) -> torch.Tensor:
        """The best token of each row, as a target id (what `logits` would give its argmax)."""
        return self.draft_to_target[self.lm_head(normed).argmax(-1)]

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Over the target's vocabulary: the draft vocabulary's logits in place, -inf elsewhere."""
        draft = self.lm_head(normed).float()
        full = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = draft
        return full


def load_head(directory: str | Path, target: ModelConfig, target_embed, device: torch.device, dtype: torch.dtype,
              int8: bool = False) -> Eagle3Head:
    """Read, check (every tensor's name and shape, the d2t mapping) and build a head for `target`
    (int8: its projections quantized to int8 blocks, see Eagle3Head)."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    config = read_head_config(directory, target)
    where = f"EAGLE-3 head {directory}"
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{where}: no *.safetensors (a pickled checkpoint is never loaded)")
    tensors: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    tensors[name] = st.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ModelFormatError(f"{where}: {e}") from None
    shapes = head_tensor_shapes(config)
    if "d2t" not in tensors and config.draft_vocab_size == config.vocab_size:
        tensors["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)  # the whole vocabulary: draft id = target id
    missing = sorted(set(shapes) - OPTIONAL - set(tensors))
    unknown = sorted(set(tensors) - set(shapes))
    if missing or unknown:
        raise ModelFormatError(f"{where}: " + "; ".join(p for p in (f"missing {', '.join(missing)}" if missing else "",
                                                                   f"not in the EAGLE-3 layout: {', '.join(unknown[:5])}" if unknown else "") if p))
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != shapes[name]:
            raise ModelFormatError(f"{where}: {name} has shape {tuple(tensor.shape)}, the target needs {shapes[name]} (hidden size "
                                   f"{config.hidden_size}, target hidden size {config.target_hidden_size}, vocabularies {config.draft_vocab_size}/{config.vocab_size})")
    # Verification would keep the outputs exact, but a head that drafts from NaN/Inf is broken: refused by
    # name, as an adapter's non-finite weights are (engine/lora.py).
    non_finite = sorted(name for name, tensor in tensors.items() if tensor.is_floating_point() and not all_finite(tensor))
    if non_finite:
        raise ModelFormatError(f"{where}: {', '.join(non_finite)} {'holds' if len(non_finite) == 1 else 'hold'} non-finite values")
    if "embed_tokens.weight" not in tensors and config.hidden_size != target.hidden_size:
        raise ModelFormatError(f"{where}: no embed_tokens.weight, and its hidden size {config.hidden_size} is not the target's {target.hidden_size}")
    ids = torch.arange(config.draft_vocab_size) + tensors["d2t"].long()
    if ids.min() < 0 or ids.max() >= config.vocab_size or ids.unique().numel() != ids.numel():
        raise ModelFormatError(f"{where}: d2t does not map the draft vocabulary onto distinct target ids")
    with torch.inference_mode():
        return Eagle3Head(config, tensors, target_embed, device, dtype, target.max_position, int8)


def all_finite(tensor: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """No NaN or Inf in tensor, checked a chunk of elements at a time (a large embedding's isfinite mask
    would otherwise be a second copy of it in bytes)."""
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(part).all()) for part in flat.split(chunk))
