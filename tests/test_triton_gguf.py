"""The Triton GGUF-block matmul (kernels/triton_gguf.py) against the dequantized weights, under
TRITON_INTERPRET=1 on CPU (tests/conftest.py sets it when there is no GPU): every block format —
the file's Q4_0 / Q4_1 / Q8_0, the K-quants as the loader re-lays them out (Q4_K: K4, Q5_K/Q6_K: K8)
and what int8 / int4 quantize into —, decode and prefill row counts, ragged N, each epilogue, float32
(IEEE) and float16 activations."""

import pytest
import torch
import torch.nn.functional as F

from gguf_factory import checkpoint_layout_weight, k_quant_blocks
from kvpilot.kernels.quantized import K_QUANTS, FP8Activations, GGUFWeight, cat_rows, quantize_int4, quantize_int8
from kvpilot.kernels.triton_gguf import fp8_activations, gguf_linear


def weight(kind: str, n: int, k: int, gen: torch.Generator) -> GGUFWeight:
    dense = torch.randn(n, k, generator=gen) * 0.05
    if kind == "int8":
        return quantize_int8(dense)
    if kind.startswith("int4"):
        return quantize_int4(dense, int(kind.split("-g")[1]))
    raw_q = torch.randint(0, 256, (n, k // 32, 16 if kind != "Q8_0" else 32), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001).half()
    m = (torch.randn(n, k // 32, generator=gen) * 0.01).half() if kind == "Q4_1" else None
    return GGUFWeight(kind, raw_q.reshape(n, -1).contiguous(), d, m)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "int8", "int4-g64", "int4-g128"])
@pytest.mark.parametrize("m", [1, 5, 37])  # decode, a small batch, prefill past one row tile
def test_matches_the_dequantized_weights(kind, m):
    gen = torch.Generator().manual_seed(m * 7 + len(kind))
    w = weight(kind, 200, 192, gen)  # N not a multiple of the column tile; K three 64-column steps
    x = torch.randn(m, 192, generator=gen)
    bias = torch.randn(200, generator=gen)
    ref = x @ w.dequantize().T + bias
    torch.testing.assert_close(gguf_linear(x, w, bias), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", K_QUANTS)
@pytest.mark.parametrize("m", [1, 37])
def test_k_quants_match_the_dequantized_weights(kind, m):
    """The K-quant layouts read in the kernel (Q4_K: nibbles with a float32 scale and min per 32 columns;
    Q5_K: int8 codes with a scale and min per 16; Q6_K: a scale only) give x @ dequantized.T — the
    values GGUF's reference dequantization gives (tests/test_quantized.py)."""
    gen = torch.Generator().manual_seed(m)
    w = GGUFWeight.from_blocks(kind, torch.from_numpy(k_quant_blocks(kind, 200, 2, seed=m, scale=0.002)), 200)
    x, bias = torch.randn(m, 512, generator=gen), torch.randn(200, generator=gen)
    dense = w.dequantize()
    assert dense.abs().max() > 0.1  # the random scales make real weights, not zeros
    torch.testing.assert_close(gguf_linear(x, w, bias), x @ dense.T + bias, atol=1e-4, rtol=1e-4)
    half = gguf_linear(x.half(), w, bias, epilogue="silu")  # float16 activations, as on CUDA
    torch.testing.assert_close(half.float(), F.silu(x.half().float() @ dense.half().float().T + bias), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1"])
def test_five_bit_blocks_as_the_loader_relays_them_out(kind):
    """Q5_0 (re-laid out as Q8_0) and Q5_1 (as K8), from the gguf package's blocks: x @ dequantized.T."""
    import gguf
    from gguf.quants import quantize

    gen = torch.Generator().manual_seed(len(kind))
    dense_file = torch.randn(200, 192, generator=gen) * 0.05
    raw = torch.from_numpy(quantize(dense_file.numpy(), getattr(gguf.GGMLQuantizationType, kind)))
    w = GGUFWeight.from_blocks(kind, raw, 200)
    x, bias = torch.randn(5, 192, generator=gen), torch.randn(200, generator=gen)
    torch.testing.assert_close(gguf_linear(x, w, bias), x @ w.dequantize().T + bias, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["Z4", "Z8", "F8"])
@pytest.mark.parametrize("m", [1, 37])
def test_checkpoint_layouts_match_the_checkpoints_values(kind, m):
    """Z4 / Z8 (a pre-quantized checkpoint's codes with a byte zero point per 32 columns) read in the
    kernel as (code − zero)·scale, F8 (FP8 E4M3 bytes, every finite one) as fp8·scale, widened in
    registers: x @ values.T, the values computed in float64 by the test."""
    gen = torch.Generator().manual_seed(m + len(kind))
    w, values = checkpoint_layout_weight(kind, 200, 192, gen)
    x, bias = torch.randn(m, 192, generator=gen), torch.randn(200, generator=gen)
    torch.testing.assert_close(gguf_linear(x, w, bias), x @ values.T + bias, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("act", [FP8Activations(scale=0.02), FP8Activations(), FP8Activations(group=64)], ids=["static", "token", "group64"])
def test_fp8_weights_with_fp8_activations_match_the_same_rounding_in_torch(act):
    """An FP8 W8A8 checkpoint's activation quantization in the kernel (static per tensor, dynamic per token
    and per 64-column group of a token) against the torch reference that applies the same scales
    (fp8_activations: x / s rounded to e4m3, times s) to x before x @ values.T — with the operands widened in
    the tile and as e4m3 operands of tl.dot (FP8 tensor cores; forced here); it changes the product by far
    more than the bound, so the rounding is really applied. Fused projections take the largest static scale."""
    gen = torch.Generator().manual_seed(5)
    w, values = checkpoint_layout_weight("F8", 200, 192, gen)
    w = GGUFWeight(w.kind, w.qs, w.d, act=act)
    x, bias = torch.randn(37, 192, generator=gen) * 3, torch.randn(200, generator=gen)
    got, want = gguf_linear(x, w, bias), fp8_activations(x, act) @ values.T + bias
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got - (x @ values.T + bias)).abs().max() > 100 * 1e-4
    # the FP8 tensor-core form (e4m3 operands in tl.dot, the scales after each 32-column product), which the
    # interpreter runs exactly: the same values
    torch.testing.assert_close(gguf_linear(x, w, bias, fp8_dot=True), want, atol=1e-4, rtol=1e-4)
    half = gguf_linear(x.half(), w, bias)  # (x rounded to float16 first can land on another e4m3 value: the reference takes it too)
    torch.testing.assert_close(half.float(), fp8_activations(x.half().float(), act) @ values.half().float().T + bias, atol=3e-2, rtol=3e-2)
    if act.scale is not None:
        assert cat_rows([w, GGUFWeight(w.kind, w.qs, w.d, act=FP8Activations(scale=0.05))]).act == FP8Activations(scale=0.05)
    with pytest.raises(ValueError, match="quantized differently"):
        cat_rows([w, GGUFWeight(w.kind, w.qs, w.d)])


@pytest.mark.parametrize("epilogue", ["silu", "mul", "add"])
def test_fused_epilogues(epilogue):
    gen = torch.Generator().manual_seed(3)
    w = weight("Q4_1", 96, 96, gen)  # K = 96: 32-column steps
    x, other = torch.randn(3, 2, 96, generator=gen), torch.randn(3, 2, 96, generator=gen)
    y = x @ w.dequantize().T
    ref = {"silu": F.silu(y), "mul": y * other, "add": y + other}[epilogue]
    out = gguf_linear(x, w, epilogue=epilogue, other=None if epilogue == "silu" else other)
    assert out.shape == (3, 2, 96)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_float16_activations_accumulate_in_float32():
    gen = torch.Generator().manual_seed(5)
    w = weight("Q8_0", 64, 256, gen)
    x = torch.randn(4, 256, generator=gen).half()
    out = gguf_linear(x, w)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), x.float() @ w.dequantize().half().float().T, atol=2e-3, rtol=2e-3)


def test_bad_operands_are_refused_by_name():
    gen = torch.Generator().manual_seed(1)
    w = weight("Q4_0", 32, 64, gen)
    with pytest.raises(ValueError, match="x has 32 columns, the weight 64"):
        gguf_linear(torch.randn(1, 32), w)
    with pytest.raises(ValueError, match="needs `other`"):
        gguf_linear(torch.randn(1, 64), w, epilogue="add")
    with pytest.raises(ValueError, match="activations must be"):
        gguf_linear(torch.randn(1, 64, dtype=torch.float64), w)


def test_dispatch_picks_triton_for_cuda_and_when_forced(monkeypatch):
    """The projection factory's choice (no GPU needed to ask it): CUDA weights get the Triton kernel,
    CPU weights the C++ one unless KVPILOT_KERNELS=triton; a bad value is refused by name."""
    from kvpilot.kernels.linear import gguf_linear_class
    from kvpilot.kernels.ops import KERNELS_ENV
    from kvpilot.kernels.quantized import GGUFLinear
    from kvpilot.kernels.triton_gguf import TritonGGUFLinear

    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert gguf_linear_class(torch.device("cuda")) is TritonGGUFLinear
    assert gguf_linear_class(torch.device("cpu")) is GGUFLinear
    monkeypatch.setenv(KERNELS_ENV, "triton")
    assert gguf_linear_class(torch.device("cpu")) is TritonGGUFLinear
    monkeypatch.setenv(KERNELS_ENV, "tritn")
    with pytest.raises(ValueError, match="must be one of default, triton, reference, not 'tritn'"):
        gguf_linear_class(torch.device("cpu"))

