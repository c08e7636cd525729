"""Tiny random models of each supported family, written as real Hugging Face checkpoints by
transformers itself (config classes, save_pretrained, safetensors) and as GGUF files by the `gguf`
package from the same weights — the test inputs of the model-family tests (nothing can be downloaded).

Every model uses the bundled SmolLM2 tokenizer (saved by transformers from the bundled GGUF), so
prompts tokenize the same everywhere. Weights are drawn larger than transformers' default init, and
biases and norm weights are randomised too (transformers starts them at 0 and 1), so that every
weight shows in the outputs and the greedy choices are not near-ties.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 49152  # SmolLM2's tokenizer
SMALL_WINDOW = 12  # tokens: the sliding-window families' window, shorter than most test prompts


@dataclass(frozen=True)
class Case:
    name: str
    architecture: str
    config: dict[str, Any]
    legacy_rope_fields: bool = False   # rewrite config.json the way transformers 4 wrote it (rope_theta + rope_scaling)
    max_shard_size: str | None = None  # shard the safetensors (with model.safetensors.index.json)
    generation_eos: list[int] = field(default_factory=list)
    dtype: str = "float32"             # the stored weights' dtype (the engine computes in fp32 on CPU)


COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
CASES = {c.name: c for c in (
    # Llama 3: llama3 RoPE scaling (all three frequency bands in use), untied head, GQA 2:1, head_dim 64, sharded.
    Case("llama3", "LlamaForCausalLM", dict(COMMON, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}, rope_theta=500000.0),
         legacy_rope_fields=True, max_shard_size="1MB", generation_eos=[2, 0]),
    # Mistral: a sliding window shorter than the prompts and outputs, tied head, GQA 4:1, head_dim 32, bf16 weights.
    Case("mistral", "MistralForCausalLM", dict(COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
         sliding_window=SMALL_WINDOW, rope_theta=10000.0), dtype="bfloat16"),
    # Qwen2: q/k/v biases, linear RoPE scaling, tied head.
    Case("qwen2", "Qwen2ForCausalLM", dict(COMMON, num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
         rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=1000000.0), legacy_rope_fields=True),
    # Qwen3: per-head q/k RMSNorm, explicit head_dim 128 (!= hidden / heads), untied head.
    Case("qwen3", "Qwen3ForCausalLM", dict(COMMON, num_attention_heads=2, num_key_value_heads=1, head_dim=128, tie_word_embeddings=False,
         rope_theta=1000000.0)),
    # Gemma 3: six layers (five through a window shorter than the prompts, one global: the pattern its GGUFs imply), their
    # two RoPE bases, (1 + w) and sandwich norms, QK-norm, GeGLU, scaled embeddings, one KV head, head_dim 64; an untied head
    # (the bundled Gemma 3 270M's tied one is tested against transformers in tests/test_gemma3.py).
    Case("gemma3", "Gemma3ForCausalLM", dict(COMMON, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
         tie_word_embeddings=False, sliding_window=SMALL_WINDOW, query_pre_attn_scalar=64, hidden_activation="gelu_pytorch_tanh",
         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Qwen3-MoE: 8 experts of 64, two a token, renormalised (as Qwen3-30B-A3B), q/k norms; its second layer a dense MLP
    # (mlp_only_layers; the GGUF holds no router there either).
    Case("qwen3moe", "Qwen3MoeForCausalLM", dict(COMMON, num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=False,
         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1], rope_theta=1000000.0)),
    # Qwen2-MoE: 8 experts of 64, two a token, not renormalised (as Qwen1.5-MoE), a shared expert of 96 beside them, q/k/v biases.
    Case("qwen2moe", "Qwen2MoeForCausalLM", dict(COMMON, num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96, norm_topk_prob=False,
         rope_theta=1000000.0)),
    # Mixtral: 8 experts of 64 (intermediate_size), two a token, GQA 2:1, untied head.
    Case("mixtral", "MixtralForCausalLM", dict(COMMON, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
         tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0)),
)}


def save_tokenizer(gguf_path: Path, dest: Path) -> Path:
    """The bundled GGUF's tokenizer as transformers saves it: tokenizer.json, tokenizer_config.json,
    chat_template.jinja."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(dest))
    return dest


def build_checkpoint(case: Case, dest: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    import shutil

    import torch
    import transformers

    config_class = getattr(transformers, CONFIG_CLASSES.get(case.architecture, case.architecture.replace("ForCausalLM", "Config")))
    model_class = getattr(transformers, case.architecture)
    config = dict(case.config)
    if "rope_parameters" in config:  # given as transformers 5 spells it (Gemma 3's per layer kind)
        pass
    elif "rope_scaling" in config:  # transformers 5 spells it rope_parameters (theta included)
        config["rope_parameters"] = {**config.pop("rope_scaling"), "rope_theta": config.pop("rope_theta")}
        config["rope_parameters"].setdefault("rope_type", config["rope_parameters"].pop("type", "default"))
    else:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    torch.manual_seed(seed)
    model = model_class(config_class(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:  # (Gemma's scale by 1 + w)
                p.uniform_(-0.5, 0.5) if case.architecture == "Gemma3ForCausalLM" else p.uniform_(0.5, 1.5)
            elif name == "model.embed_tokens.weight" and case.architecture == "Gemma3ForCausalLM":
                p.div_(config["hidden_size"] ** 0.5)  # Gemma multiplies them by √hidden: else the token itself outweighs every layer
    kwargs = {"max_shard_size": case.max_shard_size} if case.max_shard_size else {}
    model.to(getattr(torch, case.dtype)).save_pretrained(str(dest), **kwargs)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, dest / f.name)
    if GGUF_ARCH[case.architecture] in QWEN_ARCHS:
        # Qwen's tokenizer (Qwen2Tokenizer, for Qwen3 too) has its own pre-tokenizer regex (digits one
        # by one, newlines apart), imposed by transformers whatever tokenizer.json says; saved by it,
        # the files say so too, as the real Qwen checkpoints' files do.
        from transformers import Qwen2Tokenizer

        Qwen2Tokenizer.from_pretrained(str(dest)).save_pretrained(str(dest))
    if case.legacy_rope_fields:
        cfg = json.loads((dest / "config.json").read_text())
        cfg.pop("rope_parameters")
        cfg["rope_theta"], cfg["rope_scaling"] = case.config["rope_theta"], case.config["rope_scaling"]
        (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    if case.generation_eos:
        (dest / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": case.generation_eos}))
    return dest


QWEN_ARCHS = ("qwen2", "qwen3", "qwen2moe", "qwen3moe")
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "Gemma3ForCausalLM": "gemma3", "Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe",
             "MixtralForCausalLM": "llama"}
CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}  # (Gemma3Config is the multimodal model's)
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_GEMMA_BLOCK = {**_BLOCK, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def write_family_gguf(checkpoint: Path, bundled_gguf: Path, dest: Path, types: dict[str, str] | None = None) -> Path:
    """The checkpoint's weights (F32) as a GGUF the way llama.cpp's converter lays it out (q/k rows
    permuted for the llama architecture, Llama 3 scaling as a rope_freqs tensor), with the bundled
    GGUF's tokenizer metadata. types: checkpoint name -> a GGML type to store that weight in instead (a mixture of experts'
    stacked weights by their stacked names, model.layers.N.mlp.experts.gate_proj.weight…)."""
    import gguf
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from gguf_factory import encode_k_quant

    cfg = AutoConfig.from_pretrained(str(checkpoint))
    arch = GGUF_ARCH[cfg.architectures[0]]
    state: dict[str, torch.Tensor] = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        state.update(load_file(str(f)))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(dest), arch)
    w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32(f"{arch}.attention.key_length", head_dim)
    w.add_uint32(f"{arch}.attention.value_length", head_dim)
    w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # (Gemma 3: the global layers'; the local base is implied)
    w.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        w.add_uint32(f"{arch}.expert_count", experts)
        w.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
        if arch in ("qwen2moe", "qwen3moe"):
            w.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)
        state = _stacked_experts(state, experts)
    if getattr(cfg, "sliding_window", None) and cfg.architectures[0] in ("MistralForCausalLM", "Gemma3ForCausalLM"):
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", cfg.rope_parameters["factor"])
    elif rope_type == "llama3":
        base = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    _copy_tokenizer_metadata(bundled_gguf, w, pre="qwen2" if arch in QWEN_ARCHS else None)
    for name, t in state.items():
        data = t.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            data = data.reshape(heads, 2, head_dim // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        if name.endswith("shared_expert_gate.weight"):  # llama.cpp's converter writes it [hidden]
            data = data.reshape(-1)
        if arch == "gemma3" and name.endswith("norm.weight"):  # llama.cpp's converter stores Gemma's norms as 1 + w
            data = data + 1
        if name in (types or {}):
            kind = types[name]
            blocks = encode_k_quant(kind, data) if kind.endswith("_K") else gguf.quants.quantize(data, gguf.GGMLQuantizationType[kind])
            w.add_tensor(_gguf_name(name, arch), blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            w.add_tensor(_gguf_name(name, arch), np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def _stacked_experts(state: dict, experts: int) -> dict:
    """Per-expert matrices (Qwen3-MoE's mlp.experts.{e}.gate_proj…, Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2) stacked
    [experts, out, in] under one name each, as llama.cpp's converter writes them."""
    import re

    import torch

    spelled = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    out, stacks = {}, {}
    for name, t in state.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", name)
        if m:
            stacks.setdefault(f"model.layers.{m[1]}.mlp.experts.{spelled.get(m[3], m[3])}.weight", {})[int(m[2])] = t
        else:
            out[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = t
    for name, parts in stacks.items():
        out[name] = torch.stack([parts[e] for e in range(experts)])
    return out


def _gguf_name(name: str, arch: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{(_GEMMA_BLOCK if arch == 'gemma3' else _BLOCK)[module]}.{kind}"


def _copy_tokenizer_metadata(src: Path, writer, pre: str | None) -> None:
    """The bundled GGUF's tokenizer, with llama.cpp's pre-tokenizer name `pre` when given."""
    from kvpilot.server.gguf_loader import copy_metadata

    copy_metadata(_gguf_file(src), writer, {"tokenizer.ggml.pre": pre} if pre else None, keep=lambda key: key.startswith("tokenizer."))


@functools.cache
def _gguf_file(path: Path):
    """One parse of the bundled GGUF per process (its tokenizer arrays are read for every family)."""
    from kvpilot.server.gguf_loader import GGUFFile

    return GGUFFile(path)
