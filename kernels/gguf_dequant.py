"""GGUF block formats dequantized with torch (the reference the quantized-matmul kernels are held to).

Each function takes the raw bytes of a tensor as a uint8 tensor of shape [rows, bytes_per_row] and
returns float32 [rows, cols]. Results are bit-equal to the `gguf` package's numpy dequantize: same
formulas, same fp32 operation order.
  Q4_0: 32 weights per 18-byte block: fp16 d, 16 bytes of 4-bit codes; w = (q - 8)·d
  Q4_1: 32 weights per 20-byte block: fp16 d, fp16 m, 16 bytes of codes; w = q·d + m
  Q8_0: 32 weights per 34-byte block: fp16 d, 32 int8 codes; w = q·d
In a 4-bit block the low nibbles hold weights 0–15 and the high nibbles weights 16–31.
"""

from __future__ import annotations

import torch

QK = 32  # weights per block for all three formats


def _blocks(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    rows = raw.shape[0]
    return raw.reshape(rows, -1, block_bytes)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.float32)


def dequantize_q4_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, 18)
    d = _f16(blocks[..., 0:2])
    q = _nibbles(blocks[..., 2:]) - 8.0
    return (d * q).reshape(raw.shape[0], -1)


def dequantize_q4_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, 20)
    d = _f16(blocks[..., 0:2])
    m = _f16(blocks[..., 2:4])
    q = _nibbles(blocks[..., 4:])
    return (d * q + m).reshape(raw.shape[0], -1)


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, 34)
    d = _f16(blocks[..., 0:2])
    q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)
    return (d * q).reshape(raw.shape[0], -1)
