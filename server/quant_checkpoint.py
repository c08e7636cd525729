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
- compressed-tensors (llm-compressor): `format` pack-quantized — `<p>.weight_packed` int32 [out, in · bits
  / 32], input element i at bit i·bits of its row, each stored as its signed code + 2^(bits−1);
  `<p>.weight_scale` [out, groups] (strategy group, channel or tensor); an asymmetric scheme's
  `<p>.weight_zero_point` packed the same way along the *output* dimension; `<p>.weight_shape`, and an
  act-order `<p>.weight_g_idx`. naive-quantized / int-quantized: `<p>.weight` int8 signed codes beside
  its scale (and zero point). float-quantized: `<p>.weight` float8_e4m3fn times its scale (per tensor or
  channel). Activation scales (W8A8 schemes) are not used: activations stay in the compute dtype.

Kept packed where the block kernels can use them (groups of whole 32-column blocks; an act-order weight's
columns put in group order, its input gathered into that order per call):
4-bit with every zero point 8 (symmetric GPTQ) -> Q4_0 (d = the scale); other 4-bit -> Z4 (d = the scale,
the zero point a byte: w = d·(q − z), see kernels/quantized.py); 8-bit with every zero point 128 -> Q8_0;
other 8-bit -> Z8; all exact, the scale repeated per 32 columns (4.75 / 8.75 bits per weight: at most 1.15×
a group-128 checkpoint's bytes). Scales float16 does not hold exactly (bfloat16 ones usually do) -> the K8
layout (int8 codes, float32 scale and min per 16 columns: exact, 12 bits per weight).
FP8 E4M3 weights -> F8 (their bytes, a float32 scale per 32 columns: exact) when each 32-column block of a
row has one scale. Groups that are not whole blocks (FP8 scale blocks too) and act-order weights split by
input columns (tensor parallelism) are dequantized at load, in float32: correct, at the compute dtype's memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from kvpilot.kernels.quantized import K8_BLOCK, QK, FP8Activations, GGUFWeight
from kvpilot.server.model_config import ModelFormatError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: word slot i -> output column offset
COMPRESSED = "compressed-tensors"
FP8 = "fp8"
CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")
# Stored beside a compressed-tensors module's weights, not used here (activations stay in the compute
# dtype): read and set aside, so that they are not reported as unused weights.
CT_UNUSED = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point")
# An attention module's FP8 KV-cache scales (kv_cache_scheme): Checkpoint.kv_scales reads them.
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")


@dataclass(frozen=True)
class QuantScheme:
    method: str        # "gptq", "awq", "compressed-tensors" or "fp8"
    bits: int          # 4 or 8
    group_size: int    # input columns per scale; -1: one group per output channel (the whole input)
    zero_offset: int   # added to each stored zero point (GPTQ v1: 1)
    fmt: str = ""      # compressed-tensors: one of CT_FORMATS
    symmetric: bool = True
    is_float: bool = False  # compressed-tensors float-quantized, fp8 (FP8 E4M3)
    block: tuple[int, int] | None = None  # fp8: weight_block_size (rows, columns per weight_scale_inv); None: one weight_scale
    # FP8 weights' activation quantization (W8A8), applied on CUDA: None weight-only, "static" (each module's
    # input_scale), "dynamic" (per token, or per act_group columns of a token)
    activations: str | None = None
    act_group: int | None = None

    @property
    def marker(self) -> str:
        """The suffix that marks a quantized module among the checkpoint's tensors."""
        if self.method in ("gptq", "awq"):
            return "qweight"
        if self.method == FP8:
            return "weight_scale_inv" if self.block else "weight_scale"
        return "weight_packed" if self.fmt == "pack-quantized" else "weight_scale"

    @property
    def parts(self) -> tuple[str, ...]:
        """A quantized module's stored tensors (suffixes)."""
        if self.method in ("gptq", "awq"):
            return ("qweight", "qzeros", "scales", "g_idx")
        if self.method == FP8:
            return ("weight", self.marker, "input_scale")
        stored = ("weight_packed", "weight_shape") if self.fmt == "pack-quantized" else ("weight",)
        return (*stored, "weight_scale", "weight_zero_point", "weight_g_idx", *CT_UNUSED)


def parse_scheme(config: dict, where: str) -> QuantScheme:
    """The checkpoint's quantization_config, or a ModelFormatError naming what is not loaded."""
    if not isinstance(config, dict):
        raise ModelFormatError(f"{where}: quantization_config is not an object")
    method = str(config.get("quant_method", "?")).lower()
    if method == COMPRESSED:
        return _compressed_tensors_scheme(config, where)
    if method == FP8:
        return _fp8_scheme(config, where)
    if method not in ("gptq", "awq"):
        raise ModelFormatError(f"{where}: pre-quantized checkpoints (quant_method {method!r}) are not loaded: kvpilot loads gptq, "
                               "awq, compressed-tensors and fp8 checkpoints (or use a float checkpoint or a GGUF)")
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


def _fp8_scheme(config: dict, where: str) -> QuantScheme:
    """transformers' and vLLM's `quant_method: fp8`: E4M3 weights with a weight_scale_inv per
    weight_block_size block (fine-grained, DeepSeek-V3 / Qwen3-FP8) or one weight_scale per tensor."""
    fmt = str(config.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ModelFormatError(f"{where}: fp8 weights of fmt {fmt!r} are not loaded (e4m3 is)")
    block = config.get("weight_block_size")
    if block is not None and not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelFormatError(f"{where}: weight_block_size {block!r} is not two positive integers")
    activations = str(config.get("activation_scheme", "dynamic")).lower()
    if activations not in ("dynamic", "static"):
        raise ModelFormatError(f"{where}: fp8 activation_scheme {activations!r} is not run (dynamic and static are)")
    # a block checkpoint's dynamic activations: one scale per token and weight block of columns (DeepSeek-V3's 1x128)
    group = block[1] if block and activations == "dynamic" else None
    return QuantScheme(FP8, 8, -1, 0, is_float=True, block=tuple(block) if block else None, activations=activations, act_group=group)


def _compressed_tensors_scheme(config: dict, where: str) -> QuantScheme:
    fmt = str(config.get("format", "?"))
    if fmt not in CT_FORMATS:
        raise ModelFormatError(f"{where}: compressed-tensors format {fmt!r} is not loaded ({', '.join(CT_FORMATS)} are)")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelFormatError(f"{where}: compressed-tensors quantization_config has no config_groups")
    schemes = {json_key(g.get("weights")) for g in groups.values() if isinstance(g, dict)}
    if len(schemes) != 1:
        raise ModelFormatError(f"{where}: compressed-tensors config_groups with different weight schemes are not loaded (one scheme for "
                               "every quantized module is)")
    weights = next(iter(groups.values())).get("weights")
    if not isinstance(weights, dict):
        raise ModelFormatError(f"{where}: compressed-tensors config_groups without weight quantization are not loaded")
    kind, bits, strategy = weights.get("type", "int"), weights.get("num_bits"), weights.get("strategy", "tensor")
    if fmt == "float-quantized":
        if (kind, bits) != ("float", 8):
            raise ModelFormatError(f"{where}: compressed-tensors float-quantized weights of type {kind!r} and {bits} bits are not loaded "
                                   "(FP8 E4M3 is)")
    elif kind != "int" or bits not in (4, 8):
        raise ModelFormatError(f"{where}: compressed-tensors {fmt} weights of type {kind!r} and {bits} bits are not loaded (int 4 and 8 are)")
    if strategy not in ("tensor", "channel", "group"):
        raise ModelFormatError(f"{where}: compressed-tensors weight strategy {strategy!r} is not loaded (tensor, channel and group are)")
    group = weights.get("group_size") if strategy == "group" else -1
    if not isinstance(group, int) or (group != -1 and group < 1):
        raise ModelFormatError(f"{where}: compressed-tensors group_size {group!r} is not a positive integer")
    symmetric = bool(weights.get("symmetric", True))
    activations, act_group = _ct_activations(next(iter(groups.values())).get("input_activations"), fmt, where)
    return QuantScheme(COMPRESSED, bits, group, 0, fmt, symmetric, fmt == "float-quantized", activations=activations, act_group=act_group)


def _ct_activations(args, fmt: str, where: str) -> tuple[str | None, int | None]:
    """A compressed-tensors scheme's input_activations -> (activations, act_group) for FP8 weights: static per
    tensor, or dynamic per token (a dynamic per-tensor scheme too: each token its own scale, which no
    batch-mate changes) or per group of columns. Other activations (integer W8A8) run weight-only."""
    if not isinstance(args, dict) or fmt != "float-quantized":
        return None, None
    kind, bits, strategy, dynamic = args.get("type", "int"), args.get("num_bits"), args.get("strategy", "tensor"), args.get("dynamic", False)
    if (kind, bits) != ("float", 8):  # (not FP8 activations: weight-only, as integer W8A8 runs)
        return None, None
    if not dynamic:
        if strategy != "tensor":
            raise ModelFormatError(f"{where}: static FP8 input activations of strategy {strategy!r} are not run (tensor is)")
        return "static", None
    if strategy == "group":
        group = args.get("group_size")
        if not isinstance(group, int) or group < 1:
            raise ModelFormatError(f"{where}: input activations' group_size {group!r} is not a positive integer")
        return "dynamic", group
    if strategy not in ("token", "tensor"):
        raise ModelFormatError(f"{where}: dynamic FP8 input activations of strategy {strategy!r} are not run (token, tensor and group are)")
    return "dynamic", None


def json_key(value) -> str:
    return json.dumps(value, sort_keys=True)


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
        """The block layout that holds it (module docstring), or None when none does. An act-order
        weight's columns are put in group order, the permutation kept with it (the projection gathers
        its input's columns into that order)."""
        if not self.in_column_order():
            perm = torch.argsort(self.group, stable=True)
            grouped = QuantizedTensor(self.codes[:, perm], self.zeros, self.scales, self.group[perm], self.bits, self.group_size)
            if not grouped.in_column_order():  # groups of other sizes than group_size: no block layout holds them
                return None
            weight = grouped.packed()
            return GGUFWeight(weight.kind, weight.qs, weight.d, weight.m, perm)
        n, k = self.codes.shape
        per_group = self.group_size // QK
        # per 32-column block: its group's zero point and scale
        zeros = self.zeros.repeat_interleave(per_group, dim=1)[:, :k // QK]
        scales = self.scales.repeat_interleave(per_group, dim=1)[:, :k // QK]
        if scales.dtype != torch.float16 and torch.equal(scales.half().to(scales.dtype), scales):
            scales = scales.half()  # (bfloat16 or float32 scales that float16 holds exactly, as the block layouts keep them)
        if self.bits == 4 and scales.dtype == torch.float16:  # (other scales: K8, below, keeps them exact in float32)
            q = self.codes.to(torch.uint8).reshape(n, k // QK, 2, QK // 2)  # per block: elements j and j + 16 share byte j
            qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
            if bool((zeros == 8).all()):
                return GGUFWeight("Q4_0", qs, scales.contiguous())
            return GGUFWeight("Z4", qs, scales.contiguous(), zeros.to(torch.uint8).contiguous())
        if self.bits == 8 and scales.dtype == torch.float16:
            qs = (self.codes - 128).to(torch.int8).view(torch.uint8).contiguous()
            if bool((zeros == 128).all()):
                return GGUFWeight("Q8_0", qs, scales.contiguous())
            return GGUFWeight("Z8", qs, scales.contiguous(), zeros.to(torch.uint8).contiguous())
        # K8: int8 codes with a float32 scale and min per 16 columns. Codes shifted into int8's range by
        # `shift`; min = (shift − zero) · scale: an integer of at most 9 bits times a float16 or bfloat16
        # scale, exact in float32.
        shift = 128 if self.bits == 8 else 0
        per16 = QK // K8_BLOCK
        d = scales.float().repeat_interleave(per16, dim=1).contiguous()
        m = ((shift - zeros).float() * scales.float()).repeat_interleave(per16, dim=1).contiguous()
        return GGUFWeight("Q5_K", (self.codes - shift).to(torch.int8).view(torch.uint8).contiguous(), d, m)


@dataclass
class FloatQuantized:
    """FP8 E4M3 weights [out, in] and their scale (per tensor, output channel, or element: an fp8 block grid spread)."""

    weight: torch.Tensor
    scale: torch.Tensor
    act: FP8Activations | None = None  # kept with the F8 layout; dequantized at load, the weight runs weight-only

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scale.float()

    def packed(self) -> GGUFWeight | None:
        """The F8 layout (the bytes as stored, a float32 scale per 32 columns) when each 32-column block of a
        row has one scale — per tensor, per channel, or blocks of a multiple of 32 columns (DeepSeek's 128) —
        and no byte is a NaN (the kernels widen e4m3's NaN to 480); else None: dequantized at load."""
        n, k = self.weight.shape
        if k % QK:
            return None
        blocks = self.scale.float().expand(n, k).reshape(n, k // QK, QK)
        d = blocks[..., 0]
        if not torch.equal(blocks, d[..., None].expand_as(blocks)) or bool(((self.weight.view(torch.uint8) & 0x7F) == 0x7F).any()):
            return None
        return GGUFWeight("F8", self.weight.view(torch.uint8).contiguous(), d.contiguous(), act=self.act)


def read_quantized(scheme: QuantScheme, parts: dict[str, torch.Tensor], name: str) -> QuantizedTensor | FloatQuantized:
    """A projection's stored parts -> its codes and group parameters, every shape checked."""
    if scheme.method == COMPRESSED:
        return _read_compressed(scheme, parts, name)
    if scheme.method == FP8:
        return _read_fp8(scheme, parts, name)
    missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
    if missing:
        raise ModelFormatError(f"{name} has a qweight but no {', '.join(missing)}")
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
    zeros = (zeros + scheme.zero_offset) & ((1 << scheme.bits) - 1)  # (v1 stores 2^bits − 1 for a zero point of 0: it wraps)
    return _quantized(scheme, codes, zeros.T, scales.T, parts.get("g_idx"), name)


def _quantized(scheme: QuantScheme, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               name: str) -> QuantizedTensor:
    """codes [out, in], zeros and scales [out, groups]: checked against each other and the group size."""
    n, k = codes.shape
    group_size = k if scheme.group_size == -1 else scheme.group_size
    groups = -(-k // group_size)
    group = torch.arange(k) // group_size
    if g_idx is not None:
        if tuple(g_idx.shape) != (k,) or bool(((g_idx < 0) | (g_idx >= groups)).any()):
            raise ModelFormatError(f"{name}: g_idx: expected {k} group indices in [0, {groups}), got {tuple(g_idx.shape)}")
        group = g_idx.to(torch.int64)
    if tuple(scales.shape) != (n, groups) or tuple(zeros.shape) != (n, groups):
        raise ModelFormatError(f"{name}: scales {tuple(scales.shape)} and zero points {tuple(zeros.shape)} do not match {groups} groups "
                               f"of a [{n}, {k}] weight (group_size {scheme.group_size})")
    if not torch.isfinite(scales).all():
        raise ModelFormatError(f"{name}: not every scale is finite")
    return QuantizedTensor(codes.contiguous(), zeros.contiguous(), scales.contiguous(), group, scheme.bits, group_size)


def _read_fp8(scheme: QuantScheme, parts: dict[str, torch.Tensor], name: str) -> FloatQuantized:
    weight, scale = parts.get("weight"), parts.get(scheme.marker)
    if weight is None or scale is None:
        raise ModelFormatError(f"{name}: weight and {scheme.marker} are needed")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ModelFormatError(f"{name}.weight: expected a 2-D float8_e4m3fn tensor, not {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    act = _activations(scheme, parts, name)
    if scheme.block is None:
        if scale.numel() != 1:
            raise ModelFormatError(f"{name}.weight_scale: one value per tensor expected, not {tuple(scale.shape)}")
        return FloatQuantized(weight, scale.float().reshape(1, 1), act)
    rows, cols = scheme.block
    grid = (-(-n // rows), -(-k // cols))  # a partial block at the edges has its own scale
    if tuple(scale.shape) != grid:
        raise ModelFormatError(f"{name}.weight_scale_inv: {tuple(scale.shape)} is not the {grid} grid of {rows}x{cols} blocks over [{n}, {k}]")
    spread = scale.float().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]  # (despite its name, it multiplies)
    return FloatQuantized(weight, spread, act)


def _activations(scheme: QuantScheme, parts: dict[str, torch.Tensor], name: str) -> FP8Activations | None:
    if scheme.activations is None:
        return None
    if scheme.activations == "dynamic":
        return FP8Activations(group=scheme.act_group)
    scale = parts.get("input_scale")
    if scale is None or scale.numel() != 1 or not (math.isfinite(float(scale.reshape(-1)[0])) and float(scale.reshape(-1)[0]) > 0):
        raise ModelFormatError(f"{name}: static FP8 activations need one positive input_scale, not {None if scale is None else tuple(scale.shape)}")
    return FP8Activations(scale=float(scale.reshape(-1)[0]))


def _read_compressed(scheme: QuantScheme, parts: dict[str, torch.Tensor], name: str) -> QuantizedTensor | FloatQuantized:
    offset = 1 << (scheme.bits - 1)  # codes are stored signed (packed: + offset); ours are unsigned
    if "weight_scale" not in parts:
        raise ModelFormatError(f"{name}: no weight_scale")
    scale = parts["weight_scale"]
    if scheme.fmt == "pack-quantized":
        if "weight_packed" not in parts or "weight_shape" not in parts:
            raise ModelFormatError(f"{name}: weight_packed and weight_shape are needed")
        n, k = (int(v) for v in parts["weight_shape"].tolist())
        packed = parts["weight_packed"]
        if packed.dtype != torch.int32 or tuple(packed.shape) != (n, -(-k * scheme.bits // 32)):
            raise ModelFormatError(f"{name}.weight_packed: {packed.dtype} {tuple(packed.shape)} does not hold a [{n}, {k}] weight of "
                                   f"{scheme.bits} bits")
        codes = _unpack(packed, scheme.bits, dim=1)[:, :k]
    else:
        weight = parts.get("weight")
        if weight is None:
            raise ModelFormatError(f"{name}: no weight")
        if scheme.is_float:
            if weight.dtype != torch.float8_e4m3fn or scale.numel() not in (1, weight.shape[0]):
                raise ModelFormatError(f"{name}: expected float8_e4m3fn weights with a scale per tensor or output channel, not {weight.dtype} "
                                       f"with {tuple(scale.shape)} scales")
            return FloatQuantized(weight, scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(1, 1), _activations(scheme, parts, name))
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ModelFormatError(f"{name}.weight: expected 2-D int8 codes, not {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        codes = weight.to(torch.int32) + offset
    scales = scale.reshape(1, 1).expand(n, 1) if scale.numel() == 1 else scale.reshape(n, -1)
    zero_point = parts.get("weight_zero_point")
    if zero_point is None or scheme.symmetric:
        zeros = torch.full(scales.shape, offset, dtype=torch.int32)
    elif scheme.fmt == "pack-quantized":  # packed along the output dimension
        zeros = _unpack(zero_point.T.contiguous(), scheme.bits, dim=1)[:, :n].T
    else:
        zeros = zero_point.to(torch.int32).reshape(n, -1) + offset
    return _quantized(scheme, codes, zeros, scales, parts.get("weight_g_idx"), name)
