"""`--load-format dummy`: a model from its config.json alone, with seeded random weights in place of its weight files
(as vLLM's dummy format): for capacity and speed tests of a model's shapes without its download — a Llama-3-8B-shaped
engine from a 1 KB config.

Each weight is made when the model reads it, on the device and in the dtype the model computes in (no host copy of a
model that may not fit there), from a generator seeded by the engine's seed and the weight's name: every rank of a
split model makes the same full tensor and keeps its own slice, and two engines with the same seed on the same kind of
device in the same dtype hold the same model (what a test's oracle loads too; a CPU's and a GPU's generators draw
differently). A matrix is N(0, 1 / its input width) (activations keep their scale through every
projection, at any width: 0.016 for a 4096-wide layer, near transformers' 0.02 initializer_range), a bias N(0, 0.02²),
a norm's scale 1 (0 for Gemma's, which scale by 1 + w). The names and shapes are transformers' for the model's family, so a checkpoint
directory's real weights and its dummy ones are read by the same code.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvpilot.server.checkpoint import CONFIG, read_json
from kvpilot.server.model_config import ModelConfig, ModelFormatError, config_from_hf

BIAS_STD = 0.02


def expected_weights(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a checkpoint of this shape holds, by its transformers name: its shape."""
    h, head = c.hidden_size, c.head_dim
    q, kv = c.num_heads * head, c.num_kv_heads * head
    weights = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        weights["lm_head.weight"] = (c.vocab_size, h)
    norms = ("input_layernorm", "post_attention_layernorm") + (("pre_feedforward_layernorm", "post_feedforward_layernorm") if c.family.gemma else ())
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        weights |= {a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, q)}
        if c.family.qkv_bias or c.attention_bias:
            weights |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
        if c.attention_bias:
            weights[a + "o_proj.bias"] = (h,)
        if c.family.qk_norm:
            weights |= {a + "q_norm.weight": (head,), a + "k_norm.weight": (head,)}
        weights |= {p + n + ".weight": (h,) for n in norms}
        weights |= _experts(c, p) if c.is_moe(i) else _gated_mlp(p + "mlp.", ("gate_proj", "up_proj", "down_proj"), h, c.intermediate_size, c.mlp_bias)
    return weights


def _gated_mlp(prefix: str, names: tuple[str, str, str], hidden: int, inner: int, bias: bool = False) -> dict[str, tuple[int, ...]]:
    gate, up, down = names
    weights = {f"{prefix}{gate}.weight": (inner, hidden), f"{prefix}{up}.weight": (inner, hidden), f"{prefix}{down}.weight": (hidden, inner)}
    if bias:
        weights |= {f"{prefix}{gate}.bias": (inner,), f"{prefix}{up}.bias": (inner,), f"{prefix}{down}.bias": (hidden,)}
    return weights


def _experts(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A mixture of experts' router and experts as each family's checkpoints name them (Qwen's mlp.experts.{e}.gate_proj…,
    Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2), and Qwen2-MoE's shared expert with its gate."""
    h = c.hidden_size
    m, names = (p + "block_sparse_moe.", ("w1", "w3", "w2")) if c.family.moe == "mixtral" else (p + "mlp.", ("gate_proj", "up_proj", "down_proj"))
    weights = {m + "gate.weight": (c.num_experts, h)}
    for e in range(c.num_experts):
        weights |= _gated_mlp(f"{m}experts.{e}.", names, h, c.moe_intermediate_size)
    if c.shared_expert_intermediate_size:
        weights |= _gated_mlp(p + "mlp.shared_expert.", ("gate_proj", "up_proj", "down_proj"), h, c.shared_expert_intermediate_size)
        weights[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return weights


@dataclass(frozen=True)
class DummyWeights:
    """A WeightSource (models/decoder.py) over a checkpoint directory's config.json whose weights are made, not read (a
    quantization_config there is not: the weights are float, the engine says so)."""

    path: Path
    config: ModelConfig
    seed: int
    shapes: dict[str, tuple[int, ...]]
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    memory_mapped = False  # load() returns owned tensors

    @classmethod
    def of(cls, path: Path, seed: int) -> DummyWeights:
        if not (path / CONFIG).is_file():
            raise ModelFormatError(f"{path}: load_format=dummy makes a model from a checkpoint directory's {CONFIG}, and there is none")
        config = config_from_hf(read_json(path / CONFIG), path.name, str(path))
        return cls(path, config, seed, expected_weights(config))

    def on(self, device: torch.device, dtype: torch.dtype) -> DummyWeights:
        """The same weights, made on `device` in `dtype` (where the model that reads them computes)."""
        return replace(self, device=torch.device(device), dtype=dtype)

    def checkpoint_names(self) -> set[str]:
        return set(self.shapes)

    def load(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if len(shape) == 1 and name.endswith("norm.weight"):
            return (torch.zeros if self.config.family.gemma else torch.ones)(shape, device=self.device, dtype=self.dtype)
        # 64 bits of the seed and the name (a CUDA generator keeps them all; a CPU one the low 32, where a collision between
        # two same-shaped weights of a model of thousands of them is a few in a million)
        generator = torch.Generator(device=self.device).manual_seed(int.from_bytes(hashlib.blake2b(f"{self.seed}:{name}".encode(), digest_size=8).digest()) >> 1)
        std = BIAS_STD if len(shape) == 1 else shape[-1] ** -0.5
        return torch.randn(shape, generator=generator, device=self.device, dtype=self.dtype).mul_(std)
