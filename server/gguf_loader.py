"""Reads a GGUF file: model config, tokenizer metadata and weights (dequantized to the compute dtype).

GGUF stores `attn_q`/`attn_k` rows permuted for llama.cpp's interleaved RoPE; we undo that on load
(as transformers does) so the model uses the half-split ("rotate_half") RoPE layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvpilot.kernels.gguf_dequant import (
    dequantize_q4_0,
    dequantize_q4_1,
    dequantize_q4_k,
    dequantize_q5_k,
    dequantize_q6_k,
    dequantize_q8_0,
)

SUPPORTED_ARCHITECTURES = ("llama",)
DEQUANTIZE = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1,
              "Q4_K": dequantize_q4_k, "Q5_K": dequantize_q5_k, "Q6_K": dequantize_q6_k}  # GGML type name -> raw blocks to float32


class GGUFError(ValueError):
    pass


@dataclass(slots=True)
class LlamaConfig:
    name: str
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


def _field_value(field: Any) -> Any:
    """A GGUF metadata value as a Python value (str, number, or list of them)."""
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


class GGUFFile:
    """Metadata and tensors of one GGUF file (memory-mapped; tensors are read on demand)."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self._reader = GGUFReader(self.path)
        except FileNotFoundError:
            raise
        except Exception as e:  # the gguf reader raises plain ValueError/struct errors on bad files
            raise GGUFError(f"{self.path}: not a readable GGUF file ({e})") from e
        self.metadata = {name: _field_value(f) for name, f in self._reader.fields.items() if not name.startswith("GGUF.")}
        self.tensors = {t.name: t for t in self._reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return self.get("general.architecture", "")

    def llama_config(self) -> LlamaConfig:
        arch = self.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"{self.path.name}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        scaling = self.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", None) or "rope_freqs.weight" in self.tensors:
            raise GGUFError(f"{self.path.name}: RoPE scaling {scaling!r} is not supported yet")

        def need(key: str) -> Any:
            value = self.get(f"{arch}.{key}")
            if value is None:
                raise GGUFError(f"{self.path.name}: metadata key {arch}.{key} is missing")
            return value

        hidden, heads = need("embedding_length"), need("attention.head_count")
        tokens = self.get("tokenizer.ggml.tokens") or []
        return LlamaConfig(
            name=self.get("general.name", self.path.stem),
            vocab_size=self.get(f"{arch}.vocab_size", len(tokens)),
            hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_layers=need("block_count"),
            num_heads=heads,
            num_kv_heads=self.get(f"{arch}.attention.head_count_kv", heads),
            head_dim=self.get(f"{arch}.rope.dimension_count", hidden // heads),
            rope_theta=float(self.get(f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            max_position=need("context_length"),
            tie_word_embeddings="output.weight" not in self.tensors,
        )

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor dequantized to `dtype`, shaped [rows, cols] in PyTorch order ([out, in])."""
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
        return out.to(dtype)

    def tensor_names(self) -> Iterator[str]:
        return iter(self.tensors)


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, interleaved pairs -> first half / second half."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_truncated(src: str | Path, dest: str | Path, num_layers: int) -> Path:
    """A copy of a llama GGUF keeping only its first num_layers decoder blocks (tensors byte for byte,
    metadata as is but the block count): a draft model for speculative decoding that shares the
    tokenizer by construction."""
    from gguf import GGUFValueType, GGUFWriter

    reader = GGUFFile(src)._reader
    arch = _field_value(reader.fields["general.architecture"])
    total = _field_value(reader.fields[f"{arch}.block_count"])
    if not 1 <= num_layers <= total:
        raise GGUFError(f"num_layers must be in [1, {total}], got {num_layers}")
    writer = GGUFWriter(str(dest), arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = num_layers if name == f"{arch}.block_count" else _field_value(f)
        if f.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(name, value, GGUFValueType.ARRAY, sub_type=f.types[-1])
        else:
            writer.add_key_value(name, value, f.types[0])
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= num_layers:
            continue
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dest)
