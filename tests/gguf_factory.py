"""Writes small synthetic GGUF files (real format, written by the `gguf` package) for loader tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]], arch: str = "llama", metadata: dict | None = None,
               alignment: int | None = None, typed_metadata: list[tuple[str, object, object]] | None = None) -> Path:
    """tensors: name -> (float32 data [rows, cols], GGML type name such as "Q4_0", "F16", "BF16");
    typed_metadata: (key, value, gguf.GGUFValueType) written as that type; alignment: general.alignment."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, kind in typed_metadata or []:
        w.add_key_value(key, value, kind)
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


def encode_k_quant(kind: str, w: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> Q4_K or Q6_K super-blocks uint8 [rows, K / 256 * block bytes]:
    a plain min/max (Q4_K) or absmax (Q6_K) quantizer — real K-quant files for the tests, since the gguf
    package cannot write them."""
    rows, k = w.shape
    f16 = lambda a: a.astype(np.float16)  # noqa: E731
    if kind == "Q4_K":
        sub = w.reshape(rows, k // 256, 8, 32).astype(np.float32)
        lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)
        scale = (hi - lo) / 15
        d, dmin = f16(np.maximum(scale.max(-1), 1e-6) / 63), f16(np.maximum((-lo).max(-1), 1e-6) / 63)
        sc = np.clip(np.round(scale / d.astype(np.float32)[..., None]), 1, 63).astype(np.uint8)
        mn = np.clip(np.round(-lo / dmin.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
        step, offset = d.astype(np.float32)[..., None] * sc, dmin.astype(np.float32)[..., None] * mn
        q = np.clip(np.round((sub + offset[..., None]) / step[..., None]), 0, 15).astype(np.uint8)  # [rows, blocks, 8, 32]
        scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                                 (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], axis=-1)
        codes = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(rows, -1, 128)  # sub-blocks 2g (low nibbles), 2g + 1 (high)
        parts = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), scales, codes]
    elif kind == "Q6_K":
        sub = w.reshape(rows, k // 256, 16, 16).astype(np.float32)
        s = np.abs(sub).max(-1) / 31
        d = f16(np.maximum(s.max(-1), 1e-6) / 127)
        sc = np.clip(np.round(s / d.astype(np.float32)[..., None]), 1, 127).astype(np.int8)
        step = d.astype(np.float32)[..., None] * sc
        q = (np.clip(np.round(sub / step[..., None]), -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 4, 32)  # [.., half, quarter, 32]
        low = (q[..., 0:2, :] & 15) | ((q[..., 2:4, :] & 15) << 4)  # byte 64h + 32i + t: values 128h + 32i + t (low), + 64 (high nibble)
        high = sum((q[..., j, :] >> 4) << (2 * j) for j in range(4))  # byte 32h + t: bits 2j of value 128h + 32j + t
        parts = [low.reshape(rows, -1, 128), high.reshape(rows, -1, 64), sc.view(np.uint8), d[..., None].view(np.uint8)]
    else:
        raise ValueError(f"no encoder for {kind}")
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(rows, -1))


def checkpoint_layout_weight(kind: str, n: int, k: int, gen):
    """A random weight in a layout of pre-quantized checkpoints — Z4 / Z8 (codes, float16 scales and byte zero
    points per 32 columns) or F8 (float8_e4m3fn bytes, every finite one including subnormals, with a float32
    scale per 32 columns) — and its values computed here in float64: (code − zero)·scale, fp8·scale."""
    import torch

    from kvpilot.kernels.quantized import GGUFWeight

    if kind == "F8":
        raw = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
        raw = torch.where((raw & 0x7F) == 0x7F, raw & 0xF0, raw)  # no NaN bytes (0x7F, 0xFF)
        scales = torch.rand(n, k // 32, generator=gen) * 1e-3 + 1e-5
        values = (raw.view(torch.float8_e4m3fn).double() * scales.double().repeat_interleave(32, 1)).float()
        return GGUFWeight(kind, raw, scales), values
    bits = 4 if kind == "Z4" else 8
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    zeros = torch.randint(0, 1 << bits, (n, k // 32), generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4).half()
    values = ((codes - zeros.repeat_interleave(32, 1)).double() * scales.double().repeat_interleave(32, 1)).float()
    if bits == 4:
        q = codes.to(torch.uint8).reshape(n, k // 32, 2, 16)  # byte j of a block: element j low, j + 16 high
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2)
    else:
        qs = (codes - 128).to(torch.int8).view(torch.uint8)
    return GGUFWeight(kind, qs.contiguous(), scales, zeros.to(torch.uint8)), values
