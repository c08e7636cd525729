"""Reads a GGUF file: model config, tokenizer metadata and weights (dequantized to the compute dtype).

GGUF stores `attn_q`/`attn_k` rows permuted for llama.cpp's interleaved RoPE; we undo that on load
(as transformers does) so the model uses the half-split ("rotate_half") RoPE layout.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvpilot.kernels.gguf_dequant import (
    dequantize_q4_0,
    dequantize_q4_1,
    dequantize_q4_k,
    dequantize_q5_0,
    dequantize_q5_1,
    dequantize_q5_k,
    dequantize_q6_k,
    dequantize_q8_0,
)
from kvpilot.server.model_config import (
    FAMILIES,
    GEMMA3_LOCAL_ROPE_THETA,
    GGUF_FAMILIES,
    ModelConfig,
    ModelFormatError,
    RopeScaling,
    attention_heads,
    gemma3_sliding_layers,
    gguf_family_for,
)

DEQUANTIZE = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1, "Q5_0": dequantize_q5_0, "Q5_1": dequantize_q5_1,
              "Q4_K": dequantize_q4_k, "Q5_K": dequantize_q5_k, "Q6_K": dequantize_q6_k}  # GGML type name -> raw blocks to float32

# GGUF tensor names -> the checkpoint (transformers) names the model code loads by.
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
                "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                # a mixture of experts' router and its experts' weights, stacked [experts, out, in] (llama.cpp's layout)
                "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
                "ffn_down_exps": "mlp.experts.down_proj",
                # Qwen2-MoE's shared expert and its gate ([hidden] in the file, transformers' [1, hidden])
                "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's Llama 3 RoPE scaling, read into ModelConfig.rope_scaling


class GGUFError(ModelFormatError):
    pass


# Gemma's four norms a layer (llama.cpp's names for them; its ffn_norm is the norm before the MLP there too).
_GEMMA_BLOCK_NAMES = {**_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}


def checkpoint_name(gguf_name: str, gemma: bool = False) -> str:
    """The transformers name of a GGUF tensor (unchanged when it has none); `gemma`: a Gemma layer's norms."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    names = _GEMMA_BLOCK_NAMES if gemma else _BLOCK_NAMES
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return gguf_name


def _field_value(field: Any) -> Any:
    """A GGUF metadata value, as gguf's GGUFReader holds it, as a Python value."""
    from gguf import GGUFValueType

    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        item = field.types[-1]
        if item == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


# GGUF value types (gguf.GGUFValueType) with a fixed size -> their little-endian numpy dtype.
_SCALAR_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_FLOAT_TENSOR_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its GGUF (ggml) shape, innermost dimension first, and its bytes as a
    read-only view of the mapped file — float and integer types as their numpy type, [outer dims...,
    row bytes] uint8 for block-quantized ones (gguf's GGUFReader's layout)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_bytes: int
    data: np.ndarray


class _HeaderCursor:
    """Reads a GGUF header front to back. gguf's GGUFReader makes a numpy view per value (seconds for a
    tokenizer's 100k strings; 6 s of the bundled model's 8 s load); this decodes straight from the map."""

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        text = self.buf[self.pos:end].decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item not in _SCALAR_DTYPES:
                raise ValueError(f"array of GGUF value type {item} is not supported")
            dtype = np.dtype(_SCALAR_DTYPES[item])
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos += dtype.itemsize * count
            return values
        if kind not in _SCALAR_DTYPES:
            raise ValueError(f"unknown GGUF value type {kind}")
        dtype = np.dtype(_SCALAR_DTYPES[kind])
        value = np.frombuffer(self.buf, dtype, 1, self.pos)[0].item()
        self.pos += dtype.itemsize
        return value


def _read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, int | None]], dict[str, GGUFTensor]]:
    """A little-endian GGUF v2/v3 file's metadata, each value's GGUF type (an array's with its items'
    type) and its tensors (views of the mapped file)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _HeaderCursor(buf)
    if cursor.scalar("<I") != 0x46554747:
        raise ValueError("no GGUF magic")
    version = cursor.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (big-endian files are not read; versions 2 and 3 are)")
    n_tensors, n_kv = cursor.scalar("<Q"), cursor.scalar("<Q")
    metadata, value_types = {}, {}
    for _ in range(n_kv):
        key = cursor.string()
        kind = cursor.scalar("<I")
        value_types[key] = (kind, struct.unpack_from("<I", buf, cursor.pos)[0] if kind == _ARRAY else None)
        metadata[key] = cursor.value(kind)
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
        infos.append((name, dims, GGMLQuantizationType(cursor.scalar("<I")), cursor.scalar("<Q")))
    alignment = metadata.get("general.alignment", 32)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two")
    start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in infos:
        if name in tensors:
            raise ValueError(f"tensor {name!r} appears twice")
        block, type_size = GGML_QUANT_SIZES[kind]
        elements = math.prod(dims)
        n_bytes = elements * type_size // block
        outer = tuple(reversed(dims[1:]))
        if kind.name in _FLOAT_TENSOR_DTYPES:
            dtype, count, shape = np.dtype(_FLOAT_TENSOR_DTYPES[kind.name]), elements, (*outer, dims[0])
        else:
            dtype, count, shape = np.dtype(np.uint8), n_bytes, (*outer, dims[0] // block * type_size)
        if start + offset + n_bytes > len(buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = np.frombuffer(buf, dtype, count, start + offset).reshape(shape)
        tensors[name] = GGUFTensor(name, kind, np.array(dims, dtype=np.uint64), n_bytes, data)
    return metadata, value_types, tensors


class GGUFFile:
    """Metadata and tensors of one GGUF file (memory-mapped; tensors are read on demand, as copies)."""

    memory_mapped = False  # tensor() and load() return owned tensors
    packed_format = "gguf"  # what load_packed() keeps: its blocks

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.metadata, self.value_types, self.tensors = _read_gguf(self.path)
        except FileNotFoundError:
            raise
        except (ValueError, KeyError, struct.error, OverflowError) as e:  # a truncated or foreign file
            raise GGUFError(f"{self.path}: not a readable GGUF file ({e})") from e

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return self.get("general.architecture", "")

    @cached_property
    def config(self) -> ModelConfig:
        arch = self.architecture
        family = gguf_family_for(arch, self.path.name)
        if arch == "llama" and self.get("llama.expert_count"):  # Mixtral's GGUFs: the llama architecture with experts
            family = FAMILIES["MixtralForCausalLM"]

        def need(key: str) -> Any:
            value = self.get(f"{arch}.{key}")
            if value is None:
                raise GGUFError(f"{self.path.name}: metadata key {arch}.{key} is missing")
            return value

        hidden = need("embedding_length")
        heads, kv_heads, head_dim = self._attention_heads(arch, hidden, need("attention.head_count"))
        tokens = self.get("tokenizer.ggml.tokens") or []
        return ModelConfig(
            name=self.get("general.name", self.path.stem),
            family=family,
            vocab_size=self.get(f"{arch}.vocab_size", len(tokens)),
            hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_layers=need("block_count"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=float(self.get(f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            max_position=need("context_length"),
            tie_word_embeddings="output.weight" not in self.tensors,
            rope_scaling=self._rope_scaling(arch),
            attention_bias="blk.0.attn_output.bias" in self.tensors,
            mlp_bias="blk.0.ffn_down.bias" in self.tensors,
            sliding_window=self.get(f"{arch}.attention.sliding_window"),
            **(self._gemma3_facts(arch, hidden, heads, head_dim) if family.gemma else {}),
            **(self._moe_facts(arch) if family.moe else {}),
        )

    def _moe_facts(self, arch: str) -> dict[str, Any]:
        """A mixture of experts' metadata as llama.cpp reads it: softmax gating, the top-k weights renormalised but for
        qwen2moe (expert_weights_norm, where a file states it, decides); an expert's inner size expert_feed_forward_length
        (qwen2moe, qwen3moe) or feed_forward_length (Mixtral); qwen2moe's shared expert expert_shared_feed_forward_length
        wide. MoE layers: those with a router (all of them in llama.cpp's files)."""
        experts, top_k = self.get(f"{arch}.expert_count"), self.get(f"{arch}.expert_used_count")
        inner = self.get(f"{arch}.expert_feed_forward_length") or self.get(f"{arch}.feed_forward_length")
        if not experts or not top_k or not inner or top_k > experts:
            raise GGUFError(f"{self.path.name}: a mixture of experts needs {arch}.expert_count, {arch}.expert_used_count (at most the "
                            f"count) and {arch}.expert_feed_forward_length")
        gating = self.get(f"{arch}.expert_gating_func")
        if gating not in (None, 1):  # 1: softmax
            raise GGUFError(f"{self.path.name}: {arch}.expert_gating_func={gating} is not supported (softmax is)")
        shared = self.get(f"{arch}.expert_shared_feed_forward_length") or 0
        if arch == "qwen2moe" and not shared:
            raise GGUFError(f"{self.path.name}: a qwen2moe file needs {arch}.expert_shared_feed_forward_length (its shared expert's width)")
        layers = tuple(f"blk.{i}.ffn_gate_inp.weight" in self.tensors for i in range(self.get(f"{arch}.block_count") or 0))
        return {"num_experts": experts, "experts_per_token": top_k, "moe_intermediate_size": inner,
                "norm_topk_prob": bool(self.get(f"{arch}.expert_weights_norm", arch != "qwen2moe")),
                "moe_layers": () if all(layers) else layers, "shared_expert_intermediate_size": shared}

    def _gemma3_facts(self, arch: str, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
        """What a gemma3 GGUF does not state, as llama.cpp (and transformers reading the file) fix it: five sliding
        layers to one global, the local RoPE base, GeGLU; the query scale head_dim ** -0.5 but for the 62-layer
        model (27B: query_pre_attn_scalar = hidden / heads)."""
        layers = self.get(f"{arch}.block_count")
        scalar = hidden // heads if layers == 62 else head_dim
        return {"sliding_layers": gemma3_sliding_layers(layers), "rope_local_theta": GEMMA3_LOCAL_ROPE_THETA, "query_scale": scalar ** -0.5,
                "hidden_act": "gelu_tanh"}

    def _attention_heads(self, arch: str, hidden: int, heads: Any) -> tuple[int, int, int]:
        """(heads, K/V heads, head size) through model_config.attention_heads (the check config.json's
        pass), its refusals naming this file's metadata keys: K/V heads default to the heads, a head is
        attention.key_length wide, else rope.dimension_count, else embedding_length / heads."""
        dim_keys = [f"{arch}.attention.key_length", f"{arch}.rope.dimension_count"]
        dim_key = next((k for k in dim_keys if self.get(k) is not None), None)
        keys = {"num_attention_heads": f"{arch}.attention.head_count", "num_key_value_heads": f"{arch}.attention.head_count_kv",
                "head_dim": dim_key or " or ".join(dim_keys), "hidden_size": f"{arch}.embedding_length"}
        try:
            return attention_heads(self.path.name, hidden, heads, self.get(keys["num_key_value_heads"]),
                                   None if dim_key is None else self.get(dim_key))
        except ModelFormatError as e:
            message = str(e).removeprefix(f"{self.path.name}: ")
            message = re.sub(r"\b(" + "|".join(keys) + r")\b", lambda m: keys[m[1]], message)
            raise GGUFError(f"{self.path.name}: {message}") from None

    def _rope_scaling(self, arch: str) -> RopeScaling | None:
        kind = self.get(f"{arch}.rope.scaling.type", "none")
        if ROPE_FREQS in self.tensors:
            if kind not in ("none", None):
                raise GGUFError(f"{self.path.name}: both {ROPE_FREQS} and RoPE scaling {kind!r}")
            return RopeScaling("factors", freq_factors=tuple(self.tensor(ROPE_FREQS).flatten().tolist()))
        if kind in ("none", None):
            return None
        if kind == "linear":
            return RopeScaling("linear", factor=float(self.get(f"{arch}.rope.scaling.factor")))
        raise GGUFError(f"{self.path.name}: RoPE scaling {kind!r} is not supported (linear and Llama 3's rope_freqs are)")

    def checkpoint_names(self) -> set[str]:
        """The weights this file holds, by their transformers names (what the model code loads)."""
        return {checkpoint_name(n, self._gemma) for n in self.tensors if n != ROPE_FREQS}

    def load(self, name: str) -> torch.Tensor:
        """A weight by its transformers name, in the layout transformers uses: float32 (or the file's
        float type), Llama-family q/k rows back in half-split RoPE order, Gemma's norm weights w where the
        file holds llama.cpp's 1 + w (minus 1 in float32, as transformers reads them)."""
        gguf_name = self._gguf_names[name] if name in self._gguf_names else name
        t = self.tensor(gguf_name)
        if self._gemma and name.endswith("norm.weight"):
            t = t - 1
        c = self.config
        if c.family.gguf_rope_interleaved and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            t = unpermute_rope_rows(t, c.num_kv_heads if ".k_proj." in name else c.num_heads)
        return t

    def load_packed(self, name: str, expert: int | None = None):
        """A weight by its transformers name kept in its GGUF blocks (kernels.quantized.GGUFWeight), with
        q/k rows back in half-split RoPE order; None when the file stores it as floats. expert: of a stacked
        experts' weight [experts, out, in], that expert's matrix."""
        from kvpilot.kernels.quantized import FIVE_BITS, K_QUANTS, KINDS, GGUFWeight

        gguf_name = self._gguf_names[name] if name in self._gguf_names else name
        t = self.tensors[gguf_name]
        kind = t.tensor_type.name
        if kind in ("F32", "F16", "BF16"):
            return None
        kept = (*KINDS, *K_QUANTS, *FIVE_BITS)
        if kind not in kept:
            raise GGUFError(f"{self.path.name}: tensor {gguf_name!r} is {kind}; quantization=gguf keeps {', '.join(kept)} blocks "
                            f"(use quantization=none: every GGML type this loader reads is dequantized then)")
        raw = np.asarray(t.data).view(np.uint8)
        if expert is not None:  # ne [in, out, experts]: the expert's rows of blocks
            rows, raw = int(t.shape[1]), raw.reshape(int(t.shape[-1]), -1)[expert]
        else:
            rows = int(t.shape[-1]) if len(t.shape) > 1 else 1
        w = GGUFWeight.from_blocks(kind, torch.from_numpy(np.array(raw, copy=True)), rows)
        c = self.config
        if c.family.gguf_rope_interleaved and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            w = w.rows(unpermute_rope_rows(torch.arange(rows), c.num_kv_heads if ".k_proj." in name else c.num_heads))
        return w

    @cached_property
    def _gguf_names(self) -> dict[str, str]:
        return {checkpoint_name(n, self._gemma): n for n in self.tensors}

    @cached_property
    def _gemma(self) -> bool:
        family = GGUF_FAMILIES.get(self.architecture)
        return family is not None and family.gemma

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor by its GGUF name, shaped [rows, cols] in PyTorch order ([out, in]): quantized types
        dequantized to float32, float types as stored; then cast to `dtype` when given."""
        from gguf import GGMLQuantizationType as Q

        try:
            t = self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path.name}: tensor {name!r} is missing") from None
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        kind = t.tensor_type
        data = t.data
        if kind in (Q.F32, Q.F16):
            out = torch.from_numpy(np.array(data, copy=True)).reshape(shape)
        elif kind == Q.BF16:
            raw = torch.from_numpy(np.array(data, copy=True).view(np.int16))
            out = raw.view(torch.bfloat16).reshape(shape)
        elif kind.name in DEQUANTIZE:
            raw = torch.from_numpy(np.array(data, copy=True).view(np.uint8)).reshape(-1, data.shape[-1])
            out = DEQUANTIZE[kind.name](raw).reshape(shape)
        else:
            raise GGUFError(f"{self.path.name}: tensor {name!r} has type {kind.name}, which is not supported "
                            f"(F32, F16, BF16, {', '.join(DEQUANTIZE)} are)")
        return out if dtype is None else out.to(dtype)


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, interleaved pairs -> first half / second half."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def copy_metadata(src: GGUFFile, writer: Any, values: dict[str, Any] | None = None, keep=lambda key: True) -> None:
    """src's metadata (the keys `keep` takes; `values` replacing some) into a gguf.GGUFWriter, each
    value with its own GGUF type. The architecture is the writer's own."""
    from gguf import GGUFValueType

    for key, value in src.metadata.items():
        if key == "general.architecture" or not keep(key):
            continue
        kind, item = src.value_types[key]
        value = (values or {}).get(key, value)
        if item is None:
            writer.add_key_value(key, value, GGUFValueType(kind))
        else:
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType(item))


def write_truncated(src: str | Path, dest: str | Path, num_layers: int) -> Path:
    """A copy of a llama GGUF keeping only its first num_layers decoder blocks (tensors byte for byte,
    metadata as is but the block count): a draft model for speculative decoding that shares the
    tokenizer by construction."""
    from gguf import GGUFWriter

    source = GGUFFile(src)
    arch = source.architecture
    total = source.get(f"{arch}.block_count")
    if not 1 <= num_layers <= total:
        raise GGUFError(f"num_layers must be in [1, {total}], got {num_layers}")
    writer = GGUFWriter(str(dest), arch)
    copy_metadata(source, writer, {f"{arch}.block_count": num_layers})
    for t in source.tensors.values():
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= num_layers:
            continue
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dest)
