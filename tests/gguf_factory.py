"""Writes small synthetic GGUF files (real format, written by the `gguf` package) for loader tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]], arch: str = "llama", metadata: dict | None = None) -> Path:
    """tensors: name -> (float32 data [rows, cols], GGML type name such as "Q4_0", "F16", "BF16")."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, (data, kind) in tensors.items():
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            w.add_tensor(name, data.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


K_QUANT_LAYOUT = {"Q4_K": (144, [(0, 2), (2, 4)]), "Q5_K": (176, [(0, 2), (2, 4)]), "Q6_K": (210, [(208, 210)])}  # block bytes, fp16 fields


def k_quant_blocks(kind: str, rows: int, blocks: int, seed: int = 0, scale: float = 0.05) -> np.ndarray:
    """Raw K-quant super-blocks uint8 [rows, blocks * block bytes]. The gguf package cannot quantize
    K-quants, so the bytes are random with finite fp16 scales (~N(0, scale)): every code, sub-block
    scale and min bit pattern is exercised."""
    block_bytes, halves = K_QUANT_LAYOUT[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    for lo, hi in halves:
        raw[..., lo:hi] = (rng.standard_normal((rows, blocks, 1)) * scale).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)
