"""Reads a Hugging Face checkpoint directory: config.json, one or many *.safetensors (with
model.safetensors.index.json), memory-mapped and read one tensor at a time, so that loading never
holds more than the model in its compute dtype plus one tensor.

The tokenizer side (tokenizer.json, tokenizer_config.json, chat_template.jinja,
generation_config.json) is read by kvpilot.server.tokenizer.
"""

from __future__ import annotations

import json
import math
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from kvpilot.kernels.quantized import GGUFWeight
from kvpilot.server.model_config import ModelConfig, ModelFormatError, config_from_hf
from kvpilot.server.quant_checkpoint import (
    COMPRESSED,
    CT_UNUSED,
    KV_SCALE_SUFFIXES,
    FloatQuantized,
    QuantizedTensor,
    QuantScheme,
    parse_scheme,
    read_quantized,
)

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"


def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG).is_file()


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return value


class Checkpoint:
    """config.json and the safetensors files of one checkpoint directory."""

    memory_mapped = True

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not is_checkpoint_dir(self.path):
            raise ModelFormatError(f"{self.path}: not a checkpoint directory (no {CONFIG})")
        self.hf_config = read_json(self.path / CONFIG)
        quantization = self.hf_config.get("quantization_config")
        # GPTQ / AWQ: their projections read as `<p>.weight` (server/quant_checkpoint.py)
        self.quantization: QuantScheme | None = parse_scheme(quantization, str(self.path / CONFIG)) if quantization else None
        self.config: ModelConfig = config_from_hf(self.hf_config, self.path.name, str(self.path / CONFIG))
        self._files = self._tensor_files()
        marker = f".{self.quantization.marker}" if self.quantization else None
        self._quantized = {name.removesuffix(marker) + ".weight": name.removesuffix(marker)
                           for name in self._files if marker and name.endswith(marker)}

    def _tensor_files(self) -> dict[str, Path]:
        """Tensor name -> the safetensors file that holds it."""
        from safetensors import safe_open

        index = self.path / INDEX
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelFormatError(f"{index}: no weight_map")
            files = {name: self.path / file for name, file in weight_map.items()}
            missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
            if missing:
                raise ModelFormatError(f"{index} names shards that are missing: {', '.join(missing)}")
            return files
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise ModelFormatError(f"{self.path}: no *.safetensors files (other weight formats, such as PyTorch .bin, are not loaded)")
        files: dict[str, Path] = {}
        for shard in shards:
            with safe_open(shard, framework="pt") as f:
                files.update(dict.fromkeys(f.keys(), shard))
        return files

    @cached_property
    def _handles(self) -> dict[Path, Any]:
        from safetensors import safe_open

        return {f: safe_open(f, framework="pt") for f in sorted(set(self._files.values()))}

    def checkpoint_names(self) -> set[str]:
        """Tensor names, a quantized projection's parts as its `.weight` (compressed-tensors' activation
        scales set aside: not used; KV-cache scales: kv_scales())."""
        kv = {n for n in self._files if n.endswith(KV_SCALE_SUFFIXES)}
        if not self.quantization:
            return set(self._files) - kv
        parts = {f"{prefix}.{part}" for prefix in self._quantized.values() for part in self.quantization.parts}
        unused = {n for n in self._files if n.rsplit(".", 1)[-1] in CT_UNUSED} if self.quantization.method == COMPRESSED else set()
        return (set(self._files) - parts - unused - kv) | set(self._quantized)

    def kv_scales(self) -> list[tuple[float, float]] | None:
        """The checkpoint's FP8 KV-cache scales, (k_scale, v_scale) per layer (`model.layers.N.self_attn.k_scale`,
        as llm-compressor's kv_cache_scheme writes them; the cache holds K / k_scale), or None without them."""
        scheme = (self.hf_config.get("quantization_config") or {}).get("kv_cache_scheme")
        if scheme and (scheme.get("type"), scheme.get("num_bits")) != ("float", 8):
            raise ModelFormatError(f"{self.path}: kv_cache_scheme {scheme.get('type')!r} {scheme.get('num_bits')} bits is not run: the FP8 KV "
                                   "cache takes float 8-bit scales (start without kv_cache_dtype fp8 to ignore them)")
        names = [tuple(f"model.layers.{i}.self_attn{s}" for s in KV_SCALE_SUFFIXES) for i in range(self.config.num_layers)]
        present = [all(n in self._files for n in pair) for pair in names]
        if not any(present):
            return None
        if not all(present):
            raise ModelFormatError(f"{self.path}: k_scale / v_scale for only {sum(present)} of {len(names)} layers")
        scales = [tuple(float(self._handles[self._files[n]].get_tensor(n).float().reshape(-1)[0]) for n in pair) for pair in names]
        if not all(math.isfinite(s) and s > 0 for pair in scales for s in pair):
            raise ModelFormatError(f"{self.path}: a k_scale / v_scale is not a positive finite number")
        return scales

    def _quantized_tensor(self, name: str) -> QuantizedTensor | FloatQuantized:
        prefix = self._quantized[name]
        parts = {part: self._handles[self._files[f"{prefix}.{part}"]].get_tensor(f"{prefix}.{part}")
                 for part in self.quantization.parts if f"{prefix}.{part}" in self._files}
        return read_quantized(self.quantization, parts, f"{self.path}: {prefix}")

    @property
    def packed_format(self) -> str | None:
        """What load_packed() keeps: a GPTQ or AWQ checkpoint's codes (None: a float checkpoint)."""
        return self.quantization.method if self.quantization else None

    def load_packed(self, name: str) -> GGUFWeight | None:
        """A quantized projection in the block layout that holds it (None: not quantized, or no layout
        holds it — then load() dequantizes it)."""
        return self._quantized_tensor(name).packed() if name in self._quantized else None

    def load(self, name: str) -> torch.Tensor:
        """One tensor as stored (fp32/fp16/bf16), read from its memory-mapped file; a quantized projection dequantized (float32)."""
        if name in self._quantized:
            return self._quantized_tensor(name).dequantize()
        try:
            file = self._files[name]
        except KeyError:
            raise ModelFormatError(f"{self.path}: tensor {name!r} is missing") from None
        t = self._handles[file].get_tensor(name)
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ModelFormatError(f"{self.path}: tensor {name!r} has dtype {t.dtype} (float32, float16 and bfloat16 are loaded)")
        return t
