"""Pre-quantized Hugging Face checkpoints: GPTQ (AutoGPTQ / GPTQModel) and AWQ (AutoAWQ's GEMM packing).

A quantized projection `<p>` is stored as `<p>.qweight` (int32 words of packed integer codes),
`<p>.scales` (float16 [groups, out]), `<p>.qzeros` (packed zero points, [groups, out / per word]) and,
for GPTQ, `<p>.g_idx` (int32 [in]: each input column's group). Weight = (code − zero) · scale.

- GPTQ: qweight [in / per word, out], codes packed along the *input* dimension, code i of a word in bits
  [bits·i, bits·(i+1)); qzeros packed along the output dimension the same way. Format "gptq" (v1, the
  default of AutoGPTQ and of GPTQModel's saved checkpoints) stores each zero point minus one — the
  off-by-one of the original packer — and "gptq_v2" stores it as is. desc_act ("act order") checkpoints
  carry a g_idx that is not in column order.
- AWQ (version "gemm"): qweight [in, out / 8], codes packed along the *output* dimension in the order
  0, 2, 4, 6, 1, 3, 5, 7 (word slot i holds output column 8·w + AWQ_ORDER[i]); qzeros the same; always
  4-bit with zero points.

Kept packed where the block kernels can use them (groups of whole 32-column blocks, in column order):
4-bit with every zero point 8 (symmetric GPTQ) -> Q4_0 (d = the scale: exact); other 4-bit -> Q4_1
(d = the scale, m = −zero·scale rounded to float16: within one float16 rounding of the stored value);
8-bit with every zero point 128 -> Q8_0 (exact); other 8-bit, and scales that are not float16 -> the
K8 layout (int8 codes, float32 scale and min per 16 columns: exact). Otherwise (an act-order permutation, groups that are not whole
blocks) the weight is dequantized at load, in float32: correct, at the compute dtype's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.kernels.quantized import FP16_MAX, K8_BLOCK, QK, GGUFWeight
from kvpilot.server.model_config import ModelFormatError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: word slot i -> output column offset
PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class QuantScheme:
    method: str        # "gptq" or "awq"
    bits: int          # 4 or 8
    group_size: int    # input columns per scale; -1: one group per output channel (the whole input)
    zero_offset: int   # added to each stored zero point (GPTQ v1: 1)

    @property
    def per_word(self) -> int:
        return 32 // self.bits


def parse_scheme(config: dict, where: str) -> QuantScheme:
    """The checkpoint's quantization_config, or a ModelFormatError naming what is not loaded."""
    if not isinstance(config, dict):
        raise ModelFormatError(f"{where}: quantization_config is not an object")
    method = str(config.get("quant_method", "?")).lower()
    if method not in ("gptq", "awq"):
        raise ModelFormatError(f"{where}: pre-quantized checkpoints (quant_method {method!r}) are not loaded: kvpilot loads gptq and "
                               "awq checkpoints (or use a float checkpoint or a GGUF)")
    bits = config.get("bits", config.get("w_bit"))
    group = config.get("group_size", config.get("q_group_size", 128))
    if method == "gptq":
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelFormatError(f"{where}: GPTQ checkpoint_format {fmt!r} (kernel-specific packing) is not loaded; gptq and gptq_v2 are")
        if bits not in (4, 8):
            raise ModelFormatError(f"{where}: GPTQ with {bits} bits is not loaded (4 and 8 are)")
        zero_offset = 1 if fmt == "gptq" else 0
    else:
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelFormatError(f"{where}: AWQ version {version!r} (its own packing) is not loaded; gemm is")
        if bits != 4:
            raise ModelFormatError(f"{where}: AWQ with {bits} bits is not loaded (4 is)")
        if config.get("zero_point", True) is not True:
            raise ModelFormatError(f"{where}: AWQ without zero points is not loaded")
        zero_offset = 0
    if not isinstance(group, int) or (group != -1 and group < 1):
        raise ModelFormatError(f"{where}: group_size {group!r} is not a positive integer or -1")
    return QuantScheme(method, bits, group, zero_offset)


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> integer codes (int32, values in [0, 2^bits)), code i of each word in bits [bits·i, bits·(i+1)),
    the codes of a word consecutive along `dim`."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per_word] along the last axis
    if dim == 0:
        return codes.permute(0, 2, 1).reshape(words.shape[0] * per_word, words.shape[1])
    return codes.reshape(words.shape[0], words.shape[1] * per_word)


@dataclass
class QuantizedTensor:
    """One projection's codes and group parameters, in the model's orientation: codes [out, in], zeros
    and scales [out, groups], group [in] (each input column's group)."""

    codes: torch.Tensor   # int32
    zeros: torch.Tensor   # int32 (the effective zero points)
    scales: torch.Tensor  # as stored (float16 in the checkpoints of both packers)
    group: torch.Tensor   # int64
    bits: int
    group_size: int       # input columns per group (the whole input for GPTQ's group_size -1)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: (code − zero) · scale."""
        g = self.group
        return (self.codes - self.zeros[:, g]).float() * self.scales[:, g].float()

    def in_column_order(self) -> bool:
        """Whether every group is a run of whole 32-column blocks in column order (what the block layouts hold)."""
        k = self.codes.shape[1]
        return self.group_size % QK == 0 and k % QK == 0 and torch.equal(self.group, torch.arange(k) // self.group_size)

    def packed(self) -> GGUFWeight | None:
        """The block layout that holds it (module docstring), or None when none does."""
        if not self.in_column_order():
            return None
        n, k = self.codes.shape
        per_group = self.group_size // QK
        # per 32-column block: its group's zero point and scale
        zeros = self.zeros.repeat_interleave(per_group, dim=1)[:, :k // QK]
        scales = self.scales.repeat_interleave(per_group, dim=1)[:, :k // QK]
        if self.bits == 4 and scales.dtype == torch.float16:  # (other scales: K8, below, keeps them exact in float32)
            q = self.codes.to(torch.uint8).reshape(n, k // QK, 2, QK // 2)  # per block: elements j and j + 16 share byte j
            qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
            if bool((zeros == 8).all()):
                return GGUFWeight("Q4_0", qs, scales.contiguous())
            mins = (-zeros.float() * scales.float()).clamp(-FP16_MAX, FP16_MAX).half()
            return GGUFWeight("Q4_1", qs, scales.contiguous(), mins.contiguous())
        if self.bits == 8 and scales.dtype == torch.float16 and bool((zeros == 128).all()):
            return GGUFWeight("Q8_0", (self.codes - 128).to(torch.int8).view(torch.uint8).contiguous(), scales.contiguous())
        # K8: int8 codes with a float32 scale and min per 16 columns. Codes shifted into int8's range by
        # `shift`; min = (shift − zero) · scale: an integer of at most 9 bits times a float16 or bfloat16
        # scale, exact in float32.
        shift = 128 if self.bits == 8 else 0
        per16 = QK // K8_BLOCK
        d = scales.float().repeat_interleave(per16, dim=1).contiguous()
        m = ((shift - zeros).float() * scales.float()).repeat_interleave(per16, dim=1).contiguous()
        return GGUFWeight("Q5_K", (self.codes - shift).to(torch.int8).view(torch.uint8).contiguous(), d, m)


def read_quantized(scheme: QuantScheme, parts: dict[str, torch.Tensor], name: str) -> QuantizedTensor:
    """A projection's stored parts -> its codes and group parameters, every shape checked."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    for part, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise ModelFormatError(f"{name}.{part}: expected a 2-D int32 tensor, not {t.dtype} {tuple(t.shape)}")
    if scales.dim() != 2 or scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ModelFormatError(f"{name}.scales: expected a 2-D float tensor, not {scales.dtype} {tuple(scales.shape)}")
    if scheme.method == "gptq":
        codes = _unpack(qweight, scheme.bits, dim=0).T                       # [out, in]
    else:
        order = torch.tensor(AWQ_ORDER)
        unpacked = _unpack(qweight, scheme.bits, dim=1)                     # [in, out]: slot order within each word
        codes = unpacked.reshape(unpacked.shape[0], -1, 8)[:, :, torch.argsort(order)].reshape(unpacked.shape).T
    zeros = _unpack(qzeros, scheme.bits, dim=1)                                # [groups, out]
    if scheme.method == "awq":
        zeros = zeros.reshape(zeros.shape[0], -1, 8)[:, :, torch.argsort(torch.tensor(AWQ_ORDER))].reshape(zeros.shape)
    n, k = codes.shape
    groups = 1 if scheme.group_size == -1 else -(-k // scheme.group_size)
    if tuple(scales.shape) != (groups, n) or tuple(zeros.shape) != (groups, n):
        raise ModelFormatError(f"{name}: scales {tuple(scales.shape)} and zero points {tuple(zeros.shape)} do not match {groups} groups "
                               f"of a [{n}, {k}] weight (group_size {scheme.group_size})")
    zeros = (zeros + scheme.zero_offset) & ((1 << scheme.bits) - 1)  # (v1 stores 2^bits − 1 for a zero point of 0: it wraps)
    group = torch.arange(k) // (k if scheme.group_size == -1 else scheme.group_size)
    if "g_idx" in parts:
        g_idx = parts["g_idx"]
        if tuple(g_idx.shape) != (k,) or bool(((g_idx < 0) | (g_idx >= groups)).any()):
            raise ModelFormatError(f"{name}.g_idx: expected {k} group indices in [0, {groups}), got {tuple(g_idx.shape)}")
        group = g_idx.to(torch.int64)
    if not torch.isfinite(scales).all():
        raise ModelFormatError(f"{name}.scales: not every scale is finite")
    return QuantizedTensor(codes.contiguous(), zeros.T.contiguous(), scales.T.contiguous(), group, scheme.bits,
                           k if scheme.group_size == -1 else scheme.group_size)
