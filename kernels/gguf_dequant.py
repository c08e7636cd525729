"""GGUF block formats dequantized with torch (the reference the quantized-matmul kernels are held to).

Each function takes the raw bytes of a tensor as a uint8 tensor of shape [rows, bytes_per_row] and
returns float32 [rows, cols]. Results are bit-equal to the `gguf` package's numpy dequantize: same
formulas, same fp32 operation order.
  Q4_0: 32 weights per 18-byte block: fp16 d, 16 bytes of 4-bit codes; w = (q - 8)·d
  Q4_1: 32 weights per 20-byte block: fp16 d, fp16 m, 16 bytes of codes; w = q·d + m
  Q8_0: 32 weights per 34-byte block: fp16 d, 32 int8 codes; w = q·d
  Q5_0: 32 weights per 22-byte block: fp16 d, 4 bytes of fifth bits, 16 bytes of 4-bit codes; w = (q - 16)·d
  Q5_1: 32 weights per 24-byte block: fp16 d, fp16 m, 4 bytes of fifth bits, 16 bytes of codes; w = q·d + m
In a 4-bit block the low nibbles hold weights 0–15 and the high nibbles weights 16–31; a 5-bit block's
fifth bits are one little-endian 32-bit word, bit j for weight j.
K-quants (what `Q4_K_M`-style files mostly hold) use super-blocks of 256 weights:
  Q4_K: 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of 4-bit
        codes; sub-block j of 32: w = q·(d·scale_j) − dmin·min_j
  Q5_K: 176 bytes: as Q4_K plus 32 bytes holding each code's fifth bit
  Q6_K: 210 bytes: 128 bytes of low 4 bits, 64 bytes of high 2 bits, sixteen int8 scales, fp16 d;
        sub-block j of 16: w = (q − 32)·(d·scale_j)
"""

from __future__ import annotations

import torch


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


def q5_codes(raw: torch.Tensor, with_min: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Q5_0 / Q5_1 (with_min) blocks -> (codes uint8 [rows, K] in 0..31, d float32 [rows, K/32], m float32
    [rows, K/32] or None): w = (code − 16)·d (Q5_0), code·d + m (Q5_1)."""
    rows = raw.shape[0]
    head = 4 if with_min else 2
    blocks = _blocks(raw, head + 20)
    high = blocks[..., head:head + 4].to(torch.int64)  # the 32 fifth bits, little-endian
    word = high[..., 0] | (high[..., 1] << 8) | (high[..., 2] << 16) | (high[..., 3] << 24)
    fifth = ((word[..., None] >> torch.arange(32)) & 1).to(torch.uint8)
    low = blocks[..., head + 4:]
    codes = torch.cat([low & 0x0F, low >> 4], dim=-1) | (fifth << 4)
    m = _f16(blocks[..., 2:4])[..., 0] if with_min else None
    return codes.reshape(rows, -1), _f16(blocks[..., 0:2])[..., 0], m


def dequantize_q5_0(raw: torch.Tensor) -> torch.Tensor:
    codes, d, _ = q5_codes(raw, with_min=False)
    q = codes.reshape(raw.shape[0], -1, 32).to(torch.float32) - 16.0
    return (d[..., None] * q).reshape(raw.shape[0], -1)


def dequantize_q5_1(raw: torch.Tensor) -> torch.Tensor:
    codes, d, m = q5_codes(raw, with_min=True)
    q = codes.reshape(raw.shape[0], -1, 32).to(torch.float32)
    return (d[..., None] * q + m[..., None]).reshape(raw.shape[0], -1)


def _bits(codes: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """codes [..., groups, width] -> [..., groups * len(shifts), width]: each byte's fields at these shifts."""
    shift = torch.tensor(shifts, dtype=torch.uint8).reshape(len(shifts), 1)
    out = (codes.unsqueeze(-2) >> shift) & mask
    return out.reshape(*codes.shape[:-2], -1, codes.shape[-1])


def _k4_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins (as float32)."""
    s = packed.reshape(*packed.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales.to(torch.float32), mins.to(torch.float32)


def q4_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks -> (codes uint8 [rows, K] in 0..15, super float16 [rows, K/256, 2]: each super-block's
    (d, dmin), sub uint8 [rows, K/32, 2]: each 32-column sub-block's 6-bit (scale, min)):
    w = code·(d·scale) − dmin·min, both products exact in float32."""
    rows = raw.shape[0]
    blocks = _blocks(raw, 144)
    scales, mins = _k4_scales(blocks[..., 4:16])  # [rows, blocks, 8] each
    q = _bits(blocks[..., 16:].reshape(rows, -1, 4, 32), [0, 4], 0x0F)  # [rows, blocks, 8, 32]
    sub = torch.stack([scales, mins], dim=-1).to(torch.uint8).reshape(rows, -1, 2)
    return q.reshape(rows, -1), blocks[..., 0:4].contiguous().view(torch.float16), sub


def k_quant_parts(kind: str, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Q4_K / Q5_K / Q6_K blocks -> (codes int8 [rows, K], scales float32 [rows, K/16], mins float32 [rows,
    K/16] or None for Q6_K): w = code·scale + min per 16 columns, the super-block's d and dmin already
    multiplied in. The dequantize functions below are exactly that; the CPU kernels keep these parts
    for Q5_K/Q6_K (Q4_K: q4_k_parts)."""
    rows = raw.shape[0]
    per16 = lambda t: t.repeat_interleave(2, dim=-1).reshape(rows, -1)  # noqa: E731 — a sub-block of 32 is two of 16
    if kind == "Q4_K":
        codes, sup, sub = q4_k_parts(raw)
        d, dmin = (sup[..., i].float().repeat_interleave(8, dim=-1) for i in (0, 1))  # per sub-block of 32
        return codes.to(torch.int8), per16(d * sub[..., 0].float()), per16(-(dmin * sub[..., 1].float()))
    if kind == "Q6_K":
        blocks = _blocks(raw, 210)
        scales = blocks[..., 192:208].contiguous().view(torch.int8).to(torch.float32)
        d = _f16(blocks[..., 208:210]) * scales  # [rows, blocks, 16]
        low = _bits(blocks[..., 0:128].reshape(rows, -1, 2, 64), [0, 4], 0x0F).reshape(rows, -1, 8, 32)
        high = _bits(blocks[..., 128:192].reshape(rows, -1, 2, 32), [0, 2, 4, 6], 0x03)
        return ((low | (high << 4)).to(torch.int8) - 32).reshape(rows, -1), d.reshape(rows, -1), None
    if kind != "Q5_K":
        raise ValueError(f"{kind} is not a K-quant this code reads (Q4_K, Q5_K, Q6_K)")
    blocks = _blocks(raw, 176)
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    scales, mins = _k4_scales(blocks[..., 4:16])
    q = _bits(blocks[..., 48:].reshape(rows, -1, 4, 32), [0, 4], 0x0F)  # [rows, blocks, 8, 32]
    q = q | (_bits(blocks[..., 16:48].reshape(rows, -1, 1, 32), list(range(8)), 0x01) << 4)
    return q.to(torch.int8).reshape(rows, -1), per16(d * scales), per16(-(dmin * mins))


def _k_dequantize(kind: str, raw: torch.Tensor) -> torch.Tensor:
    # code·scale is exact in float32 (at most 22 significant bits for Q4_K/Q5_K), so adding the negated
    # min rounds once, as gguf's `scale·q − dmin·min` does; Q6_K is the one product.
    codes, scales, mins = k_quant_parts(kind, raw)
    w = codes.to(torch.float32).reshape(raw.shape[0], -1, 16) * scales.unsqueeze(-1)
    if mins is not None:
        w = w + mins.unsqueeze(-1)
    return w.reshape(raw.shape[0], -1)


def dequantize_q4_k(raw: torch.Tensor) -> torch.Tensor:
    return _k_dequantize("Q4_K", raw)


def dequantize_q5_k(raw: torch.Tensor) -> torch.Tensor:
    return _k_dequantize("Q5_K", raw)


def dequantize_q6_k(raw: torch.Tensor) -> torch.Tensor:
    return _k_dequantize("Q6_K", raw)
