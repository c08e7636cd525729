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
