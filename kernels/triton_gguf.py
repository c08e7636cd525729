"""x @ W.T with W in a GGUF block format (Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K:
`--quantization gguf`; int8 / int4 quantize into Q8_0 / Q4_1 blocks; pre-quantized checkpoints with
zero points in Z4 / Z8, FP8 weights in F8), dequantized inside a Triton
kernel: the GPU form of kernels/csrc/gguf_linear_cpu.cpp, with the same fused epilogues (SiLU,
· other, + residual).

It reads GGUFWeight's row layout as it is (each row's quants contiguous, scales and mins beside them;
quantized.LAYOUTS says per type how): a [BLOCK_N, BLOCK_K] tile of weights is unpacked and scaled in
registers (4-bit: byte j of a 32-weight block holds weights j and j + 16) and fed to tl.dot with a [BLOCK_M, BLOCK_K] tile of
activations, accumulating in float32. Decode (M ≤ 16) is one BLOCK_M = 16 row tile: a GEMV whose
cost is the weight read, which is what 4-bit storage cuts. Activations may be float32, float16 or
bfloat16; the output has their dtype. float32 runs tl.dot in IEEE precision (no TF32), so it matches
the dequantized reference to summation order.

Tested under TRITON_INTERPRET=1 on CPU tensors (tests/test_triton_gguf.py); on a GPU the same code
compiles for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from kvpilot.kernels.direct_call import direct_call
from kvpilot.kernels.quantized import LAYOUTS, QK, FP8Activations, GGUFWeight
from kvpilot.kernels.triton_fp8 import fp8_e4m3_bits, fp8_e4m3_value

EPILOGUES = {"none": 0, "silu": 1, "mul": 2, "add": 3}
FP8_MAX = 448.0  # e4m3fn's largest finite value
MINS = {"none": 0, "stored": 1, "minus8d": 2, "zero": 3}


@triton.jit
def dequantized_tile(qs_ptr, d_ptr, m_ptr, cols, col_ok, ks, K, CODE_BITS: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
                     MIN: tl.constexpr, SUPER: tl.constexpr):
    """float32 [BLOCK_K, BLOCK_N]: the weight's rows `cols` (those not col_ok read as 0) at input columns `ks`, dequantized
    from a GGUFWeight's row layout whose row 0 is at the pointers (K input columns a row)."""
    groups_per_row = K // GROUP
    group = ks // GROUP
    if SUPER:  # K4: d = (super-block d)·(scale code), m = −(super-block dmin)·(min code), exact in float32
        sup = d_ptr + cols[None, :] * (K // 128) + ((ks // 256) * 2)[:, None]  # (d, dmin) per 256 columns
        code = m_ptr + cols[None, :] * (groups_per_row * 2) + (group * 2)[:, None]  # (scale, min) per 32
        scale = tl.load(sup, mask=col_ok[None, :], other=0.0).to(tl.float32) * tl.load(code, mask=col_ok[None, :], other=0).to(tl.float32)
        low = -(tl.load(sup + 1, mask=col_ok[None, :], other=0.0).to(tl.float32) * tl.load(code + 1, mask=col_ok[None, :], other=0).to(tl.float32))
    else:
        scale = tl.load(d_ptr + cols[None, :] * groups_per_row + group[:, None], mask=col_ok[None, :], other=0.0).to(tl.float32)
    if CODE_BITS == 8:  # Q8_0, K8, Z8: int8 codes; F8: float8_e4m3fn bytes, widened exactly in registers
        q = tl.load(qs_ptr + cols[None, :] * K + ks[:, None], mask=col_ok[None, :], other=0)
        q = fp8_e4m3_value(q) if FP8 else q.to(tl.float32)
    else:  # Q4_0, Q4_1, K4, Z4: byte j of a 32-block holds weight j (low nibble) and j + 16 (high nibble)
        j = ks % 32
        byte = tl.load(qs_ptr + cols[None, :] * (K // 2) + ((ks // 32) * 16 + j % 16)[:, None], mask=col_ok[None, :], other=0)
        q = tl.where((j < 16)[:, None], byte & 0x0F, byte >> 4).to(tl.float32)
    if SUPER:
        w = scale * q + low
    elif MIN == 1:  # w = d·q + m
        w = scale * q + tl.load(m_ptr + cols[None, :] * groups_per_row + group[:, None], mask=col_ok[None, :], other=0.0).to(tl.float32)
    elif MIN == 2:  # Q4_0: w = d·(q - 8)
        w = scale * q - 8.0 * scale
    elif MIN == 3:  # Z4, Z8: w = d·(q − z), the integer difference first (exact); Z8's codes are stored minus 128
        zero = tl.load(m_ptr + cols[None, :] * groups_per_row + group[:, None], mask=col_ok[None, :], other=0).to(tl.float32)
        w = (q - (zero - (128.0 if CODE_BITS == 8 else 0.0))) * scale
    else:
        w = scale * q
    return w


@triton.jit
def _gguf_matmul(x_ptr, qs_ptr, d_ptr, m_ptr, bias_ptr, other_ptr, y_ptr, sx_ptr, perm_ptr,
                 M, N, K, stride_xm, stride_ym, stride_om, x_groups,
                 CODE_BITS: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, MIN: tl.constexpr, SUPER: tl.constexpr,
                 EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, ACT_FP8: tl.constexpr, X_GROUP: tl.constexpr, HAS_PERM: tl.constexpr,
                 FP8_DOT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    groups_per_row = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if HAS_PERM:  # an act-order weight: x's columns in the order the weight holds them
            x = tl.load(x_ptr + rows[:, None] * stride_xm + tl.load(perm_ptr + ks)[None, :], mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None], other=0.0)
        if FP8_DOT:  # W8A8 on FP8 tensor cores: x / s and the weight as e4m3 operands, one scale each per BLOCK_K (= 32) columns
            if X_GROUP > 0:
                s_row = tl.load(sx_ptr + rows * x_groups + k0 // X_GROUP, mask=row_ok, other=1.0)
            else:
                s_row = tl.load(sx_ptr + rows, mask=row_ok, other=1.0)
            xb = fp8_e4m3_bits(x.to(tl.float32) / s_row[:, None])
            wb = tl.load(qs_ptr + cols[None, :] * K + ks[:, None], mask=col_ok[None, :], other=0)
            d_col = tl.load(d_ptr + cols * groups_per_row + k0 // GROUP, mask=col_ok, other=0.0)
            part = tl.dot(xb.to(tl.float8e4nv, bitcast=True), wb.to(tl.float8e4nv, bitcast=True), out_dtype=tl.float32)
            acc += part * s_row[:, None] * d_col[None, :]
        else:
            if ACT_FP8:  # x / s rounded to e4m3, times s (W8A8): s per row, or per X_GROUP columns of a row
                if X_GROUP > 0:
                    s = tl.load(sx_ptr + rows[:, None] * x_groups + (ks // X_GROUP)[None, :], mask=row_ok[:, None], other=1.0)
                else:
                    s = tl.load(sx_ptr + rows, mask=row_ok, other=1.0)[:, None]
                x = (fp8_e4m3_value(fp8_e4m3_bits(x.to(tl.float32) / s)) * s).to(x.dtype)
            w = dequantized_tile(qs_ptr, d_ptr, m_ptr, cols, col_ok, ks, K, CODE_BITS, FP8, GROUP, MIN, SUPER)
            if IEEE:  # float32 activations: no TF32
                acc += tl.dot(x, w, input_precision="ieee")
            else:  # float16 / bfloat16: the tensor cores' input type, float32 accumulation
                acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if EPILOGUE == 1:
        acc = acc / (1.0 + tl.exp(-acc))
    elif EPILOGUE == 2:
        acc = acc * tl.load(other_ptr + rows[:, None] * stride_om + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    elif EPILOGUE == 3:
        acc = acc + tl.load(other_ptr + rows[:, None] * stride_om + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def layout_constants(kind: str) -> dict:
    """dequantized_tile's compile-time description of a GGUFWeight kind's layout."""
    layout = LAYOUTS[kind]
    return {"CODE_BITS": layout.code_bits, "FP8": layout.fp8, "GROUP": layout.group, "MIN": MINS[layout.mins], "SUPER": layout.scales == "super"}


def activation_scales(rows: torch.Tensor, act: FP8Activations) -> torch.Tensor:
    """float32 [M, G]: the FP8 activation scale of each row (G = 1: static, the checkpoint's, or max|x| / 448 of
    the row) or of each act.group columns of it (G = K / group)."""
    if act.scale is not None:
        return torch.full((rows.shape[0], 1), act.scale, dtype=torch.float32, device=rows.device)
    groups = rows.float().reshape(rows.shape[0], -1, act.group or rows.shape[1])
    return (groups.abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def fp8_activations(x: torch.Tensor, act: FP8Activations) -> torch.Tensor:
    """The torch reference of the kernel's activation quantization: x / s rounded to e4m3 (saturated at
    ±448), times s, in float32."""
    rows = x.reshape(-1, x.shape[-1]).float()
    s = activation_scales(rows, act).repeat_interleave(act.group or rows.shape[1], dim=1) if act.scale is None else act.scale
    return ((rows / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).reshape(x.shape)


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether tl.dot takes e4m3 operands here: CUDA GPUs of compute capability 8.9 on (Ada, Hopper, ...)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def gguf_linear(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None, epilogue: str = "none",
                other: torch.Tensor | None = None, block_n: int = 64, block_k: int | None = None,
                fp8_dot: bool | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias), then the epilogue (silu(y), y * other, y + other; other [..., N]). An F8
    weight with activation quantization (w.act) rounds x to e4m3 first, at its scales (fp8_activations), and
    where the GPU has FP8 tensor cores (fp8_dot None: fp8_tensor_cores) multiplies the e4m3 operands
    themselves, 32 columns (one weight scale) per step; elsewhere their widened values."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {k}")
    fp8_dot = w.act is not None and (fp8_tensor_cores(x.device) if fp8_dot is None else fp8_dot)
    if fp8_dot and w.act.group and w.act.group % QK:
        raise ValueError(f"FP8 tensor-core products need activation groups of a multiple of {QK} columns, not {w.act.group}")
    block_k = QK if fp8_dot else block_k or (64 if k % 64 == 0 else QK)
    if k % block_k or block_k % QK:
        raise ValueError(f"K={k} must be a multiple of BLOCK_K={block_k}, itself a multiple of {QK}")
    layout = LAYOUTS[w.kind]
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {', '.join(EPILOGUES)}")
    if (epilogue in ("mul", "add")) != (other is not None):
        raise ValueError(f"epilogue {epilogue!r} {'needs' if other is None else 'takes no'} `other`")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"activations must be float32, float16 or bfloat16, not {x.dtype}")
    rows = x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if other is not None:
        other = other.reshape(m, n).contiguous()
    qs = w.qs.view(torch.int8) if layout.code_bits == 8 and not layout.fp8 else w.qs
    if w.act is not None and (not layout.fp8 or w.perm is not None or (w.act.group and k % w.act.group)):
        raise ValueError(f"activation quantization is for F8 weights whose input splits into groups of {w.act.group}, not {w.kind} [{n}, {k}]")
    sx = activation_scales(rows, w.act) if w.act is not None else y
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gguf_matmul[grid](rows, qs, w.d, w.m if w.m is not None else w.d, bias if bias is not None else w.d,
                       other if other is not None else y, y, sx, w.perm if w.perm is not None else y, m, n, k, rows.stride(0), y.stride(0),
                       other.stride(0) if other is not None else 0, sx.shape[-1] if w.act else 1,
                       **layout_constants(w.kind),
                       EPILOGUE=EPILOGUES[epilogue], HAS_BIAS=bias is not None, ACT_FP8=w.act is not None, X_GROUP=(w.act.group or 0) if w.act else 0, HAS_PERM=w.perm is not None, FP8_DOT=fp8_dot,
                       IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y.reshape(*x.shape[:-1], n)


@direct_call
class TritonGGUFLinear(nn.Module):
    """GGUFLinear's interface (forward, silu, mul, add) on the Triton kernel. The weight stays in
    GGUFWeight's row layout, so a tied embedding's blocks (`shared`) are used where they are."""

    # The kernel's tile width in output columns (a GPU default; GPU not measured). Triton's interpreter
    # pays per program, so the CPU tests of whole engines widen it (a vocabulary-wide head is 768
    # programs at 64).
    block_n = 64

    def __init__(self, weight: GGUFWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.kind, self.out_features = weight.kind, weight.shape[0]
        self.register_buffer("qs", weight.qs)
        self.register_buffer("d", weight.d)
        self.register_buffer("m", weight.m)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        self.register_buffer("perm", None if weight.perm is None else weight.perm.to(torch.int64).contiguous())
        self.act = weight.act

    def _run(self, x: torch.Tensor, epilogue: str, other: torch.Tensor | None = None) -> torch.Tensor:
        return gguf_linear(x, GGUFWeight(self.kind, self.qs, self.d, self.m, self.perm, self.act), self.bias, epilogue, other,
                           block_n=self.block_n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, "none")

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, "silu")

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self._run(x, "mul", other)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self._run(x, "add", residual)
