"""The model's shape: one description for every supported family, read from a GGUF's metadata or a
checkpoint's config.json. torch-free.

The families differ in a few facts, kept here as data rather than as branches in the model code:
Qwen2 projects q/k/v with biases, Qwen3 RMS-normalises each query and key head before RoPE, Llama 3
rescales RoPE frequencies, Mistral may declare a sliding window. Gemma 3 does most of that and more:
(1 + w) RMSNorms, a norm after attention and one before and after the MLP, GeGLU, embeddings scaled
by √hidden, five sliding-window layers to one global one with their own RoPE base, a query scale of
its own. Everything else is one decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


class ModelFormatError(ValueError):
    """A model file or checkpoint the engine cannot load, with the reason."""


@dataclass(frozen=True, slots=True)
class Family:
    architecture: str          # the `architectures` entry of config.json
    gguf_architecture: str     # `general.architecture` of the same family's GGUF files
    qkv_bias: bool             # q/k/v projections always carry biases (Qwen2)
    qk_norm: bool              # per-head RMSNorm of queries and keys before RoPE (Qwen3)
    gguf_rope_interleaved: bool  # llama.cpp's converter permutes q/k rows for its interleaved RoPE (llama arch only)
    gemma: bool = False  # Gemma's layer: (1 + w) norms (llama.cpp's GGUFs store 1 + w), sandwich norms, embeddings × √hidden
    moe: str | None = None  # a mixture of experts' checkpoint names: "qwen" (mlp.gate, mlp.experts.{e}.gate_proj…), "mixtral"
                            # (block_sparse_moe.gate, block_sparse_moe.experts.{e}.w1/w3/w2)


FAMILIES = {f.architecture: f for f in (
    Family("LlamaForCausalLM", "llama", qkv_bias=False, qk_norm=False, gguf_rope_interleaved=True),
    Family("MistralForCausalLM", "llama", qkv_bias=False, qk_norm=False, gguf_rope_interleaved=True),
    Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True, qk_norm=False, gguf_rope_interleaved=False),
    Family("Qwen3ForCausalLM", "qwen3", qkv_bias=False, qk_norm=True, gguf_rope_interleaved=False),
    Family("Gemma3ForCausalLM", "gemma3", qkv_bias=False, qk_norm=True, gguf_rope_interleaved=False, gemma=True),
    Family("Qwen2MoeForCausalLM", "qwen2moe", qkv_bias=True, qk_norm=False, gguf_rope_interleaved=False, moe="qwen"),
    Family("Qwen3MoeForCausalLM", "qwen3moe", qkv_bias=False, qk_norm=True, gguf_rope_interleaved=False, moe="qwen"),
    Family("MixtralForCausalLM", "llama", qkv_bias=False, qk_norm=False, gguf_rope_interleaved=True, moe="mixtral"),
)}
# Mistral's GGUFs say "llama": the GGUF architecture names the Llama family for both.
# (Mixtral's say "llama" too, with an expert count.)
GGUF_FAMILIES = {"llama": FAMILIES["LlamaForCausalLM"], "qwen2": FAMILIES["Qwen2ForCausalLM"], "qwen3": FAMILIES["Qwen3ForCausalLM"],
                 "gemma3": FAMILIES["Gemma3ForCausalLM"], "qwen3moe": FAMILIES["Qwen3MoeForCausalLM"],
                 "qwen2moe": FAMILIES["Qwen2MoeForCausalLM"]}
# Gemma 3's layers: every sixth one attends globally, the others through the window, their RoPE base this (what
# transformers' config defaults to and llama.cpp fixes for the gemma3 architecture, whose GGUFs state neither).
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
HIDDEN_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config.json's hidden_act / hidden_activation -> the MLP's


def family_for(architecture: str, source: str) -> Family:
    family = FAMILIES.get(architecture)
    if family is None:
        raise ModelFormatError(f"{source}: architecture {architecture!r} is not supported (supported: {', '.join(FAMILIES)})")
    return family


def gguf_family_for(architecture: str, source: str) -> Family:
    family = GGUF_FAMILIES.get(architecture)
    if family is None:
        raise ModelFormatError(f"{source}: GGUF architecture {architecture!r} is not supported (supported: {', '.join(GGUF_FAMILIES)})")
    return family


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling. linear: every frequency divided by `factor` (positions stretched).
    llama3: low frequencies divided by `factor`, high ones kept, the band between interpolated.
    factors: the per-frequency divisors spelled out (how llama.cpp stores Llama 3's scaling)."""

    kind: Literal["linear", "llama3", "factors"]
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: tuple[float, ...] = ()  # "factors": each frequency divided by its own factor (a GGUF's rope_freqs tensor)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False      # Llama's attention_bias: q/k/v and o projections carry biases
    mlp_bias: bool = False            # Llama's mlp_bias: gate/up/down carry biases
    sliding_window: int | None = None  # attention window in tokens (Mistral, Gemma 3's local layers), None = full attention
    # Which layers attend through the window (True) and which globally: () = all of them alike (every layer through
    # sliding_window when there is one).
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None  # the RoPE base of the sliding layers when it is not rope_theta (Gemma 3's 10,000)
    query_scale: float | None = None  # the attention's score scale when it is not head_dim ** -0.5 (Gemma's query_pre_attn_scalar ** -0.5)
    # A mixture of experts (family.moe): each MoE layer's experts, how many a token is routed to, each expert's inner size,
    # whether the top-k weights are renormalised, and which layers are MoE (() = every one; the others dense MLPs).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    # Qwen2-MoE's shared expert: a gated MLP of this inner size every token goes through beside its routed experts, its
    # output scaled by sigmoid(shared_expert_gate(x)) (0: none)
    shared_expert_intermediate_size: int = 0
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_tanh (GeGLU)

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window in tokens, 0 for global attention."""
        if not self.sliding_window:
            return 0
        return self.sliding_window if not self.sliding_layers or self.sliding_layers[layer] else 0

    def is_moe(self, layer: int) -> bool:
        """Whether the layer's MLP is a mixture of experts."""
        return bool(self.num_experts) and (not self.moe_layers or self.moe_layers[layer])


def gemma3_sliding_layers(num_layers: int) -> tuple[bool, ...]:
    return tuple((i + 1) % GEMMA3_GLOBAL_EVERY != 0 for i in range(num_layers))


def rope_scaling_from_hf(params: dict[str, Any] | None, source: str) -> RopeScaling | None:
    """A config.json's rope scaling (transformers 4's `rope_scaling` or 5's `rope_parameters`)."""
    if not params:
        return None
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                           high_freq_factor=float(params["high_freq_factor"]), original_max_position=int(params["original_max_position_embeddings"]))
    raise ModelFormatError(f"{source}: RoPE scaling {kind!r} is not supported (supported: linear, llama3)")


def attention_heads(where: str, hidden: int, heads: Any, kv_heads: Any = None, head_dim: Any = None) -> tuple[int, int, int]:
    """A config.json's num_attention_heads, num_key_value_heads and head_dim (the last two None when
    absent: as many K/V heads as query heads, hidden // heads wide), refused by name (prefixed with
    `where`) when they describe no attention: a count that is not a positive integer (0 would divide by
    zero, and is no head count rather than "the default"), query heads that K/V heads do not divide, or a
    hidden size that heads do not divide when no head_dim says how wide one is."""
    def count(key: str, value: Any, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelFormatError(f"{where}: {key}={value!r} (a {what} is a positive integer)")
        return value

    heads = count("num_attention_heads", heads, "count of heads")
    kv_heads = heads if kv_heads is None else count("num_key_value_heads", kv_heads, "count of heads")
    if heads % kv_heads:
        raise ModelFormatError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if head_dim is not None:
        return heads, kv_heads, count("head_dim", head_dim, "head's size")
    if hidden % heads:
        raise ModelFormatError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads={heads} (and no head_dim is given)")
    return heads, kv_heads, hidden // heads


def config_from_hf(hf: dict[str, Any], name: str, source: str) -> ModelConfig:
    """ModelConfig from a parsed config.json."""
    architectures = hf.get("architectures") or []
    if len(architectures) != 1:
        raise ModelFormatError(f"{source}: config.json must name exactly one architecture, got {architectures!r} "
                               f"(supported: {', '.join(FAMILIES)})")
    family = family_for(architectures[0], source)

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ModelFormatError(f"{source}: config.json has no {key!r}")
        return hf[key]

    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"  # (Gemma's key first: its configs may carry both)
    if act not in HIDDEN_ACTS:
        raise ModelFormatError(f"{source}: hidden activation {act!r} is not supported ({', '.join(HIDDEN_ACTS)} are)")
    rope = hf.get("rope_parameters") or {}
    gemma = {}
    if family.gemma:
        gemma, rope = _gemma3_facts(hf, rope, source)
    scaling = rope_scaling_from_hf(rope or hf.get("rope_scaling"), source)
    hidden = need("hidden_size")
    heads, kv_heads, head_dim = attention_heads(source, hidden, need("num_attention_heads"), hf.get("num_key_value_heads"), hf.get("head_dim"))
    window = hf.get("sliding_window")
    if family.architecture not in ("MistralForCausalLM", "Gemma3ForCausalLM") and not hf.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window that is off unless use_sliding_window is set
    return ModelConfig(
        name=name,
        family=family,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0),
        rms_norm_eps=float(need("rms_norm_eps")),
        max_position=need("max_position_embeddings"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.gemma)),  # (Gemma's configs default to tied)
        rope_scaling=scaling,
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        sliding_window=int(window) if window else None,
        hidden_act=HIDDEN_ACTS[act],
        **gemma,
        **(_moe_facts(hf, family, source) if family.moe else {}),
    )


def _moe_facts(hf: dict[str, Any], family: Family, source: str) -> dict[str, Any]:
    """A mixture of experts' config.json facts (ModelConfig fields). Qwen2/Qwen3-MoE: num_experts (transformers 5 saves
    num_local_experts), moe_intermediate_size, norm_topk_prob, and its dense layers by decoder_sparse_step and
    mlp_only_layers (Qwen2-MoE also its shared expert's shared_expert_intermediate_size); Mixtral: num_local_experts of
    intermediate_size each, every layer MoE, always renormalised."""
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    top_k = hf.get("num_experts_per_tok")
    if not experts or not top_k or not 0 < top_k <= experts:
        raise ModelFormatError(f"{source}: a mixture of experts needs num_experts (or num_local_experts) and num_experts_per_tok <= it")
    if family.moe == "mixtral":
        return {"num_experts": experts, "experts_per_token": top_k, "moe_intermediate_size": hf["intermediate_size"], "norm_topk_prob": True}
    step, dense = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or ())
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(hf.get("num_hidden_layers") or 0))
    if not hf.get("moe_intermediate_size"):
        raise ModelFormatError(f"{source}: config.json has no 'moe_intermediate_size' (each expert's inner size)")
    shared = 0
    if family.architecture == "Qwen2MoeForCausalLM":
        shared = hf.get("shared_expert_intermediate_size") or 0
        if not shared or hf.get("qkv_bias") is False:
            raise ModelFormatError(f"{source}: a Qwen2-MoE needs shared_expert_intermediate_size and q/k/v biases (qkv_bias) as its "
                                   f"checkpoints have them")
    return {"num_experts": experts, "experts_per_token": top_k, "moe_intermediate_size": hf["moe_intermediate_size"],
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "moe_layers": () if all(layers) else layers,
            "shared_expert_intermediate_size": shared}


def _gemma3_facts(hf: dict[str, Any], rope: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Gemma 3 config.json's layer kinds, local RoPE base and query scale (ModelConfig fields), and the global
    layers' RoPE parameters (transformers 5 keys them by layer kind; 4 has rope_theta, rope_local_base_freq and
    rope_scaling for the global layers). Soft-capped logits (Gemma 2's) are refused: Gemma 3 has none."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise ModelFormatError(f"{source}: {key}={hf[key]!r} is not supported (Gemma 3 has none)")
    num_layers = hf.get("num_hidden_layers") or 0
    kinds = hf.get("layer_types")
    if kinds is not None:
        if len(kinds) != num_layers or set(kinds) - {"sliding_attention", "full_attention"}:
            raise ModelFormatError(f"{source}: layer_types must name sliding_attention or full_attention for each of the {num_layers} layers")
        sliding = tuple(k == "sliding_attention" for k in kinds)
    else:
        every = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or GEMMA3_GLOBAL_EVERY
        sliding = tuple((i + 1) % every != 0 for i in range(num_layers))
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5
        local_theta = float((rope.get("sliding_attention") or {}).get("rope_theta") or GEMMA3_LOCAL_ROPE_THETA)
        rope = dict(rope.get("full_attention") or {})
    else:
        local_theta = float(hf.get("rope_local_base_freq") or GEMMA3_LOCAL_ROPE_THETA)
    scalar = hf.get("query_pre_attn_scalar")
    facts = {"sliding_layers": sliding, "rope_local_theta": local_theta, "query_scale": float(scalar) ** -0.5 if scalar else None}
    return facts, rope
