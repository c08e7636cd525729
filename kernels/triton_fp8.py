"""float8_e4m3fn conversions for the Triton kernels that store into and read from an FP8 KV cache, in
integer and half-precision arithmetic: the same code on every GPU (Ampere has no FP8 conversion
instruction) and in the interpreter (whose own FP8 casts round some values wrongly), bit-exact with
torch's conversion (tests/test_triton_layers.py). The cache reaches the kernels as its uint8 bytes."""

import triton
import triton.language as tl


@triton.jit
def fp8_e4m3_bits(x):
    """float32 -> e4m3fn bits (uint8): saturated at ±448, rounded to nearest even."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    sign = (x.to(tl.uint32, bitcast=True) >> 24) & 0x80
    a = tl.abs(x)
    bits = a.to(tl.uint32, bitcast=True)
    # Normal (|x| >= 2^-6): the mantissa rounded to 3 bits, nearest even (a carry moves the exponent up,
    # as it should); float32's exponent bias 127 becomes e4m3's 7.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal: a multiple of 2^-9, rounded to nearest even by adding and taking away 2^23.
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    return (tl.where(a < 0.015625, subnormal, normal) | sign).to(tl.uint8)


@triton.jit
def fp8_e4m3_value(bits):
    """e4m3fn bits (uint8) -> float32: moved into a float16's fields (whose subnormals cover e4m3's),
    widened exactly, and scaled by 2^8 for the exponent biases' difference (15 - 7)."""
    b = bits.to(tl.uint16)
    half = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
