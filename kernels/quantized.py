"""Weights kept in GGUF's own block formats (`--quantization gguf`): Q4_0, Q4_1 and Q8_0, re-laid out
once at load for the kernels — each row's quants contiguous, its block scales (and Q4_1's mins) as
float16 beside them — and multiplied by kernels/csrc/gguf_linear_cpu.cpp, which dequantizes in
registers. The bytes per weight stay the file's (Q4_1: 20 per 32 weights); the values are exactly
those GGUF's reference dequantization gives (kernels/gguf_dequant.py). On CPUs with AVX-512 VNNI the
activations are rounded too, to 16-bit integer codes per block of 32, so that the products run as
integer dot products: mean KL vs the fp32 model 6.5e-8–7.3e-8 on the bundled model (the float path's
summation order alone: 8.9e-9; bench/history/). On CPUs with AMX tiles, from 64
rows on (prefill), both operands are split into two bfloat16s — the weights dequantized per call —
and multiplied on the tile unit (16 significant bits each).

The K-quants (what `Q4_K_M`-style files hold) are re-laid out at load, exactly GGUF's values:
- Q4_K -> "K4": Q4_1's 4-bit code layout, each 32-column sub-block's 6-bit scale and min codes as
  bytes and each 256-column super-block's float16 d and dmin as in the file
  (`gguf_dequant.q4_k_parts`); the kernels form d·scale and dmin·min per sub-block, exact in float32.
  4.625 bits per weight (the file: 4.5).
- Q5_K, Q6_K -> "K8": one int8 code per weight with a float32 scale (and Q5_K's min) per 16 columns,
  the super-block's d and dmin multiplied in (`gguf_dequant.k_quant_parts`): 12 (Q6_K: 10) bits per
  weight (the file: 5.5 / 6.6) — still under bfloat16's 16.
- Q5_0 -> Q8_0: each code minus 16 as an int8, the block's float16 d as it is (8.5 bits per weight; the
  file: 5.5). A Q5_0 weight is then a Q8_0 one, exactly: it fuses with Q8_0 parts (Gemma 3's q and k are
  Q5_0, its v Q8_0).
- Q5_1 -> K8: the codes as int8, the block's d and m as float32 for each of its two 16-column halves
  (12 bits per weight; the file: 6). code·d is exact in float32, so + m rounds once, as GGUF's does.

Two layouts hold pre-quantized checkpoints' zero points exactly (server/quant_checkpoint.py): "Z4"
(Q4_1's code layout) and "Z8" (Q8_0's, each code stored minus 128), each 32 columns with a float16
scale d and a uint8 zero point z: w = d·(q − z), which the kernels form as d·q + m with m = −d·z (Z8:
d·(128 − z)) — exact in float32, so the weights are the checkpoint's own. 4.75 and 8.75 bits per weight
(a GPTQ checkpoint of group 128: 4.16 and 8.19). "F8" holds FP8 E4M3 weights as their bytes with a
float32 scale per 32 columns (9 bits per weight), widened exactly in the kernels' registers: w = fp8·d.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels import cpu_extension
from kvpilot.kernels.direct_call import direct_call
from kvpilot.kernels.gguf_dequant import k_quant_parts, q4_k_parts, q5_codes

QK = 32  # weights per block
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # GGUF types kept in their own blocks' layout (panels, Triton)
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # re-laid out at load (K4 / K8 below; panels and Triton)
FIVE_BITS = ("Q5_0", "Q5_1")  # re-laid out at load too (as Q8_0 / K8 below)
K8, K4 = 3, 4  # the kernels' ids of the two K-quant layouts
Z4, Z8, F8 = 5, 6, 7  # ... of the zero-point layouts and of FP8 weights
K8_BLOCK = 16  # columns per K8 scale
QK_K = 256  # columns per K-quant super-block


@dataclass(frozen=True)
class Layout:
    """How the kernels read one GGUF type once it is re-laid out: every kernel (C++ panels and row
    kernel, Triton) takes its facts from here."""

    kernel_kind: int  # the C++ kernels' id: 0 Q4_0, 1 Q4_1, 2 Q8_0, 3 K8, 4 K4, 5 Z4, 6 Z8, 7 F8
    code_bits: int  # 4: two codes a byte (byte j of a 32-block: element j low, j + 16 high); 8: int8 codes
    group: int  # input columns per scale
    mins: str  # "stored" (m), "minus8d" (Q4_0: m = -8·d), "zero" (m: uint8 zero points z, w = d·(q − z)) or "none"
    scales: str  # "float16" (d, m per group: the file's), "float32" (K8: exact products per group) or
    #              "super" (K4: d float16 [N, K/256 · 2] (d, dmin); m uint8 [N, K/32 · 2] (scale, min) codes)
    split: int  # the smallest whole unit of columns (a shard's boundary): a group, or K4's super-block
    fp8: bool = False  # 8-bit codes that are float8_e4m3fn bytes (F8), not int8


LAYOUTS = {
    "Q4_0": Layout(0, 4, QK, "minus8d", "float16", QK),
    "Q4_1": Layout(1, 4, QK, "stored", "float16", QK),
    "Q8_0": Layout(2, 8, QK, "none", "float16", QK),
    "Q4_K": Layout(K4, 4, QK, "stored", "super", QK_K),
    "Q5_K": Layout(K8, 8, K8_BLOCK, "stored", "float32", K8_BLOCK),
    "Q6_K": Layout(K8, 8, K8_BLOCK, "none", "float32", K8_BLOCK),
    "Q5_1": Layout(K8, 8, K8_BLOCK, "stored", "float32", K8_BLOCK),
    "Z4": Layout(Z4, 4, QK, "zero", "float16", QK),
    "Z8": Layout(Z8, 8, QK, "zero", "float16", QK),
    "F8": Layout(F8, 8, QK, "none", "float32", QK, fp8=True),
}
ZERO_OFFSET = {"Z4": 0, "Z8": 128}  # what a stored code is short of its checkpoint code (Z8: int8 = code − 128)


@dataclass(frozen=True)
class FP8Activations:
    """An FP8 W8A8 checkpoint's activation quantization, which the CUDA (Triton) kernel applies to its F8
    weight's input: x / s rounded to e4m3, times s, with s the checkpoint's input_scale (static, per tensor) or
    max|x| / 448 of each row (dynamic, per token) or of each `group` columns of a row (dynamic per token
    group: block-FP8 checkpoints, DeepSeek's 128). The CPU kernels run such weights weight-only."""

    scale: float | None = None  # static; None: dynamic
    group: int | None = None  # dynamic: columns per scale (None: the whole row)

    @staticmethod
    def fused(parts: list[FP8Activations | None]) -> FP8Activations | None:
        """One activation scheme for projections fused into one (q, k, v): static scales become their
        largest (each input then fits), as vLLM fuses them."""
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts) or len({(p.scale is None, p.group) for p in parts}) != 1:
            raise ValueError("cannot fuse projections whose activations are quantized differently")
        return parts[0] if parts[0].scale is None else FP8Activations(max(p.scale for p in parts))


@dataclass(frozen=True)
class GGUFWeight:
    """A [N, K] weight in a GGUF block format. qs: uint8 [N, K/2] (4-bit: byte j of block b holds element
    32b + j in its low nibble and 32b + j + 16 in its high one) or [N, K] (Q8_0, int8 bit patterns);
    d: float16 [N, K/32] scales; m: float16 [N, K/32] mins (Q4_1 only). Q4_K: qs as Q4_1's, d float16
    [N, K/256 · 2] (each super-block's d, dmin), m uint8 [N, K/32 · 2] (each sub-block's scale, min codes);
    Q5_K/Q6_K: qs int8 codes [N, K], d and m float32 [N, K/16] (m None for Q6_K). Z4/Z8: qs as Q4_1's /
    Q8_0's (code − 128), d float16 [N, K/32], m uint8 [N, K/32] zero points. F8: qs float8_e4m3fn bytes
    [N, K], d float32 [N, K/32]."""

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    # An act-order checkpoint's weight: the input columns in the order its codes hold them (int64 [K]); the
    # kernels multiply x[..., perm], gathering it themselves. None: the columns in order.
    perm: torch.Tensor | None = None
    act: FP8Activations | None = None  # F8 only: the checkpoint's activation quantization (W8A8)

    @property
    def layout(self) -> Layout:
        return LAYOUTS[self.kind]

    @property
    def block(self) -> int:
        """Input columns in one whole unit of the layout (a shard splits only between them)."""
        return self.layout.split

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 8 // self.layout.code_bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    @classmethod
    def from_blocks(cls, kind: str, raw: torch.Tensor, rows: int) -> GGUFWeight:
        """From the file's blocks (uint8, `rows` rows of whole blocks) into the kernels' layout."""
        if kind == "Q4_K":
            codes, sup, sub = q4_k_parts(raw.reshape(rows, -1))
            q = codes.reshape(rows, -1, 2, QK // 2)  # per 32-block: elements j and j + 16 share byte j
            return cls(kind, (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(rows, -1).contiguous(), sup.reshape(rows, -1), sub.reshape(rows, -1))
        if kind in K_QUANTS:
            codes, d, m = k_quant_parts(kind, raw.reshape(rows, -1))  # scales and mins per 16 columns
            return cls(kind, codes.view(torch.uint8), d, m)
        if kind in FIVE_BITS:
            codes, d, m = q5_codes(raw.reshape(rows, -1), with_min=kind == "Q5_1")
            if kind == "Q5_0":  # d came from float16: back to it exactly
                return cls("Q8_0", (codes.to(torch.int8) - 16).view(torch.uint8), d.half())
            halves = lambda t: t.repeat_interleave(QK // K8_BLOCK, dim=-1)  # noqa: E731 — one block's d (m) for its two 16-column halves
            return cls(kind, codes.view(torch.uint8), halves(d), halves(m))
        if kind not in KINDS:
            raise ValueError(f"GGUF type {kind} is not one the gguf kernels take ({', '.join([*KINDS, *K_QUANTS, *FIVE_BITS])})")
        blocks = raw.reshape(rows, -1, _BLOCK_BYTES[kind])
        d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(rows, -1)
        if kind == "Q4_1":
            return cls(kind, blocks[..., 4:].reshape(rows, -1).contiguous(), d, blocks[..., 2:4].contiguous().view(torch.float16).reshape(rows, -1))
        return cls(kind, blocks[..., 2:].reshape(rows, -1).contiguous(), d)

    def rows(self, index: torch.Tensor | slice) -> GGUFWeight:
        """Some of the output rows (a permutation, a shard), as owned tensors."""
        pick = lambda t: None if t is None else t[index].contiguous()
        return GGUFWeight(self.kind, pick(self.qs), pick(self.d), pick(self.m), self.perm, self.act)

    def columns(self, start: int, end: int) -> GGUFWeight:
        """Input columns [start, end): whole blocks only (a row-parallel shard)."""
        if self.perm is not None:
            raise ValueError("an act-order weight holds its input columns permuted: it is not split by input columns")
        if start % self.block or end % self.block:
            raise ValueError(f"a {self.kind} weight splits only at multiples of {self.block} columns, not [{start}, {end})")
        units = self.shape[1] // self.block
        b0, b1 = start // self.block, end // self.block

        def cols(t: torch.Tensor | None) -> torch.Tensor | None:
            width = None if t is None else t.shape[1] // units  # its entries per unit
            return None if t is None else t[:, b0 * width:b1 * width].contiguous()

        return GGUFWeight(self.kind, cols(self.qs), cols(self.d), cols(self.m), act=self.act)

    @staticmethod
    def cat(parts: list[GGUFWeight]) -> GGUFWeight:
        """Row-wise concatenation (q, k and v into one fused projection): one format only."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse projections stored in different GGUF types ({', '.join(sorted(kinds))})")
        if not same_input_order(parts):
            raise ValueError("cannot fuse projections whose input columns are in different orders")
        m = torch.cat([p.m for p in parts]) if parts[0].m is not None else None
        return GGUFWeight(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m, parts[0].perm,
                          FP8Activations.fused([p.act for p in parts]))

    def to(self, device: torch.device) -> GGUFWeight:
        return GGUFWeight(self.kind, *(t.to(device) if t is not None else None for t in (self.qs, self.d, self.m, self.perm)), self.act)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the reference the kernels are tested against (and the embedding's row lookup),
        its columns in the input's order."""
        if self.perm is not None:
            held = GGUFWeight(self.kind, self.qs, self.d, self.m).dequantize()
            return torch.empty_like(held).index_copy_(1, self.perm.to(held.device), held)
        n, k = self.shape
        if self.layout.scales == "super":  # K4: d·scale and −dmin·min per sub-block, as q4_k_parts says
            sup, sub = self.d.float().reshape(n, -1, 1, 2), self.m.float().reshape(n, -1, 8, 2)
            d, m = (sup[..., 0] * sub[..., 0]).reshape(n, -1, 1), (-(sup[..., 1] * sub[..., 1])).reshape(n, -1, 1)
            q = self.qs.reshape(n, -1, QK // 2)
            return (torch.cat([q & 0x0F, q >> 4], dim=-1).float() * d + m).reshape(n, k)
        d = self.d.float()[..., None]
        if self.layout.mins == "zero":  # w = d·(q − z): an integer times d, exact
            if self.layout.code_bits == 8:
                q = self.qs.view(torch.int8).reshape(n, -1, QK).float() + ZERO_OFFSET[self.kind]
            else:
                q = self.qs.reshape(n, -1, QK // 2)
                q = torch.cat([q & 0x0F, q >> 4], dim=-1).float()
            return ((q - self.m.float()[..., None]) * d).reshape(n, k)
        if self.layout.code_bits == 8:  # code·scale exact, + min rounded once: as gguf_dequant's functions
            w = self.qs.view(torch.float8_e4m3fn if self.layout.fp8 else torch.int8).reshape(n, -1, self.block).float() * d
            return (w if self.m is None else w + self.m.float()[..., None]).reshape(n, k)
        q = self.qs.reshape(n, -1, QK // 2)
        q = torch.cat([q & 0x0F, q >> 4], dim=-1).float()
        m = self.m.float()[..., None] if self.m is not None else -8 * d
        return (q * d + m).reshape(n, k)


PANEL = 16  # output rows side by side in the panel layout
# The panel kernel's instruction set, normally the best this CPU has ("auto"). Naming a lower one pins a
# path: "avx512" or "avx2" keep float32 activations where the VNNI and AMX paths round them to 16 bits
# (exactness checks against a float32 reference; benchmarks of one path).
GGUF_ISA_ENV = "KVPILOT_GGUF_ISA"
GGUF_ISAS = ("auto", "amx", "avx512-vnni", "avx512", "avx2", "scalar")


def env_choice(env: str, choices: tuple[str, ...]) -> str:
    """A kernel's path named in the environment: one of `choices`, the first when unset."""
    value = os.environ.get(env, choices[0])
    if value not in choices:
        raise ValueError(f"{env}={value!r}: expected one of {', '.join(choices)}")
    return value


def gguf_isa() -> str:
    return env_choice(GGUF_ISA_ENV, GGUF_ISAS)


def to_panels(w: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The panel layout of gguf_linear_panel: qs [P, K/group, 16 (4-bit) or group (8-bit), 16 lanes],
    d and m [P, K/group, 16] (K4: d [P, K/256, 2, 16] float16, m [P, K/256, 16, 16] uint8 codes); lane
    l of panel p is output row 16p + l (rows past the end: zero scales)."""
    n, units = w.qs.shape[0], w.shape[1] // w.block
    pad = -n % PANEL

    def lay(t: torch.Tensor | None) -> torch.Tensor | None:  # [N, units · e] -> [P, units, e, 16]
        if t is None:
            return None
        t = torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t
        return t.reshape(-1, PANEL, units, t.shape[1] // units).permute(0, 2, 3, 1).contiguous()

    qs, d, m = lay(w.qs), lay(w.d), lay(w.m)
    groups = w.shape[1] // w.layout.group
    qs = qs.reshape(qs.shape[0], groups, -1, PANEL)  # K4: a super-block's bytes are its 8 groups' in order
    if w.layout.scales != "super":
        d, m = d.squeeze(2), None if m is None else m.squeeze(2)
    return qs, d, m


@direct_call
class GGUFLinear(nn.Module):
    """y = x @ W.T (+ b) with W a GGUFWeight, and the fused forms Linear has (silu, mul, add). The
    weight is re-laid out in panels of 16 output rows (one vector per input column: activations are
    broadcast, no horizontal sums). A tied embedding looks its rows up in these panels (`lookup`):
    one copy serves both."""

    def __init__(self, weight: GGUFWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.kind, self.out_features, self.in_features = weight.kind, *weight.shape
        qs, d, m = to_panels(weight)
        self.register_buffer("qs", qs)
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        self.register_buffer("perm", None if weight.perm is None else weight.perm.to(torch.int64).contiguous())
        self._ext = cpu_extension.require()
        self._isa = gguf_isa()
        self._bind()

    def _bind(self) -> None:
        # The weight operands as one plain attribute: reading registered buffers goes through
        # nn.Module.__getattr__, four lookups per call on the decode path.
        self._operands = (self.qs, self.d, self.m, LAYOUTS[self.kind].kernel_kind, self.out_features, self.bias)
        self._perm = self.perm

    def weight_rows(self, index: torch.Tensor) -> GGUFWeight:
        """Output rows `index` (int64 [n]) in the row layout, read out of the panels: lane index % 16 of
        panel index // 16 in every panel tensor is that row's entries, in the row layout's order."""
        p, lane = index // PANEL, index % PANEL
        pick = lambda t: None if t is None else t[p, ..., lane].reshape(index.shape[0], -1)
        return GGUFWeight(self.kind, pick(self.qs), pick(self.d), pick(self.m), self.perm)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` of W: a tied embedding's lookup."""
        return self.weight_rows(ids.reshape(-1)).dequantize().reshape(*ids.shape, self.in_features)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._bind()  # .to() and friends replace the buffers
        return self

    def _run(self, x: torch.Tensor, epilogue: int, other: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.float32:  # the model passes float32 rows: no reshapes or casts on its path
            rows = x.reshape(-1, x.shape[-1]).float()
            other = None if other is None else other.reshape(rows.shape[0], -1).float()
            return self._run(rows, epilogue, other).reshape(*x.shape[:-1], -1)
        return self._ext.gguf_linear_panel(x, *self._operands, epilogue, other, self._isa, self._perm)  # it checks every operand's dtype, shape and strides

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, 0)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, 1)

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self._run(x, 2, other)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self._run(x, 3, residual)


def same_input_order(parts: list[GGUFWeight]) -> bool:
    first = parts[0].perm
    return all((p.perm is None) == (first is None) and (first is None or torch.equal(p.perm, first)) for p in parts)


def cat_rows(parts: list[torch.Tensor | GGUFWeight]) -> torch.Tensor | GGUFWeight:
    """Fused projections (q, k, v): their rows one after another, dense or packed alike. Parts in
    Q4_0 and Q4_1 fuse as Q4_1 (Q4_0's implicit min −8·d, exact in float16), Q4_0 and Z4 as Z4, Q8_0 and
    Z8 as Z8 (Q4_0's zero point 8, Q8_0's 128); packed parts beside dense
    ones (a pre-quantized checkpoint that left one of them in float), or in different input orders (act
    order), fuse dequantized, in the dense parts' dtype."""
    packed = [p for p in parts if isinstance(p, GGUFWeight)]
    if len(packed) == len(parts) and same_input_order(packed):
        kinds = {p.kind for p in packed}
        if kinds == {"Q4_0", "Q4_1"}:
            packed = [GGUFWeight("Q4_1", p.qs, p.d, (-8 * p.d.float()).half()) if p.kind == "Q4_0" else p for p in packed]
        for plain, zeroed in (("Q4_0", "Z4"), ("Q8_0", "Z8")):
            if kinds == {plain, zeroed}:
                zero = 8 if plain == "Q4_0" else 128
                packed = [GGUFWeight(zeroed, p.qs, p.d, torch.full_like(p.d, zero, dtype=torch.uint8), p.perm) if p.kind == plain else p
                          for p in packed]
        return GGUFWeight.cat(packed)  # (other kinds side by side: refused by name)
    if not packed:
        return torch.cat(parts)
    dtype = next((p.dtype for p in parts if not isinstance(p, GGUFWeight)), torch.float32)
    return torch.cat([p.dequantize().to(p.d.device, dtype) if isinstance(p, GGUFWeight) else p for p in parts])


def embedding(ids: torch.Tensor, table: torch.Tensor | GGUFWeight | GGUFLinear) -> torch.Tensor:
    """Rows of an embedding table: a lookup, or for GGUF blocks (or a tied head's panels) the
    looked-up rows dequantized."""
    if isinstance(table, GGUFLinear):
        return table.lookup(ids)
    if isinstance(table, GGUFWeight):
        return table.rows(ids).dequantize()
    return F.embedding(ids, table)


# --- quantizing float weights at load (--quantization int8 / int4) --------------------------------

FP16_MAX = 65504.0


def quantize_int8(w: torch.Tensor) -> GGUFWeight:
    """Symmetric int8 per block of 32 input columns: w ≈ d · q, q in [-127, 127], d = max|w| / 127 of the
    block, as float16 (Q8_0's scheme and layout). Per 32 rather than per output channel: the kernel
    reads a scale per block either way, so the finer one costs nothing and one outlier no longer
    coarsens a whole row."""
    w = w.float()
    n, k = w.shape
    _check_blocks(k)
    blocks = w.reshape(n, k // QK, QK)
    d16 = (blocks.abs().amax(-1) / 127).clamp(max=FP16_MAX).half()
    d = d16.float()[..., None]
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1)), 0).clamp(-127, 127).to(torch.int8)
    return GGUFWeight("Q8_0", q.reshape(n, k).view(torch.uint8).contiguous(), d16.contiguous())


def quantize_int4(w: torch.Tensor, group: int) -> GGUFWeight:
    """Asymmetric int4 per group of `group` input columns (32, 64 or 128; a last, shorter group when the
    input size is not a multiple): w ≈ d · q + m, q in [0, 15], d = (max - min) / 15 and m = min of the
    group, as float16 (repeated over its 32-weight blocks: the Q4_1 kernel's layout)."""
    if group not in (32, 64, 128):
        raise ValueError(f"int4 group size must be 32, 64 or 128, not {group}")
    w = w.float()
    n, k = w.shape
    _check_blocks(k)
    blocks = w.reshape(n, k // QK, QK)
    per_group, nb = group // QK, k // QK
    pad = -nb % per_group
    lo = F.pad(blocks.amin(-1), (0, pad), value=float("inf")).reshape(n, -1, per_group).amin(-1)
    hi = F.pad(blocks.amax(-1), (0, pad), value=float("-inf")).reshape(n, -1, per_group).amax(-1)
    d16 = ((hi - lo) / 15).clamp(max=FP16_MAX).half().repeat_interleave(per_group, dim=1)[:, :nb].contiguous()
    m16 = lo.clamp(-FP16_MAX, FP16_MAX).half().repeat_interleave(per_group, dim=1)[:, :nb].contiguous()
    d, m = d16.float()[..., None], m16.float()[..., None]
    q = torch.where(d > 0, torch.round((blocks - m) / torch.where(d > 0, d, 1)), 0).clamp(0, 15).to(torch.uint8)
    q = q.reshape(n, nb, 2, QK // 2)  # per 32-block: elements j and j + 16 share byte j
    return GGUFWeight("Q4_1", (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous(), d16, m16)


def _check_blocks(k: int) -> None:
    if k % QK:
        raise ValueError(f"weight-only quantization needs input sizes that are multiples of {QK}, not {k}")
