"""Projections: every layout (oneDNN packed, kvpilot's bfloat16 panels, dense) against plain torch, fused forms included."""

import pytest
import torch
import torch.nn.functional as F

from kvpilot.kernels.linear import LAYOUTS, bf16_panels_available, make_linear, onednn_available, onednn_packs


def test_onednn_is_available_here():
    """The CPU engine's speed depends on it; CI must say so loudly when a torch build lacks it."""
    assert onednn_available()


def _available(layout: str, dtype: torch.dtype) -> bool:
    if layout == "onednn":
        return onednn_packs(dtype)
    if layout == "bf16-panels":
        return dtype == torch.bfloat16 and bf16_panels_available()
    return True


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [0, 1, 7, 17, 64])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_projections_match_torch(layout, dtype, tol, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(44, 40, generator=gen) * 0.1).to(dtype)  # 44 outputs: a whole panel of 32 and 12 of the next (a partial vector)
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    other = torch.randn(rows, 44, generator=gen).to(dtype)
    bias = torch.randn(44, generator=gen).to(dtype) if with_bias else None
    if not _available(layout, dtype):  # refused by name, not a crash in the kernel
        with pytest.raises(ValueError, match="oneDNN cannot pack torch.bfloat16|bf16-panels layout needs"):
            make_linear(w, bias=bias, layout=layout)
        assert make_linear(w, bias=bias).layout != layout  # the default takes another path there
        return
    lw = make_linear(w, bias=bias, layout=layout)
    assert lw.layout == layout and [n for n, _ in lw.named_buffers()] == ["weight", "bias"][:1 + with_bias]
    ref = (x.float() @ w.float().T) + (bias.float() if with_bias else 0)

    def close(got, want):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)

    close(lw(x), ref)
    close(lw.silu(x), F.silu(ref))
    close(lw.mul(x, other), ref * other.float())
    close(lw.add(x, other), ref + other.float())


def test_default_choice_follows_device_and_dtype():
    assert make_linear(torch.randn(4, 4)).layout == "onednn"
    assert make_linear(torch.randn(4, 4, dtype=torch.float64)).layout == "dense"  # oneDNN: fp32/bf16 only
    bf16 = make_linear(torch.randn(4, 4, dtype=torch.bfloat16)).layout
    assert bf16 == ("bf16-panels" if bf16_panels_available() else "onednn" if onednn_packs(torch.bfloat16) else "dense")
    assert make_linear(torch.randn(4, 3, dtype=torch.bfloat16)).layout != "bf16-panels"  # K in pairs: an odd K cannot


@pytest.mark.parametrize("rows", [1, 8, 16, 33])
def test_bf16_panels_equal_float32_sums_rounded_once(rows):
    """The kernel's products are exact and summed in float32: against a float64 reference, its output
    differs by bfloat16's last-place rounding (and float32's summation order) only, at model-like shapes
    — a 3-D input and an input that is a strided view included."""
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(200, 576, generator=gen) * 0.05).bfloat16()
    x = torch.randn(2, rows, 600, generator=gen).bfloat16()[..., :576]  # rows with a stride of 600
    if not bf16_panels_available():  # a CPU without AVX512-BF16: refused by name
        with pytest.raises(ValueError, match="bf16-panels layout needs"):
            make_linear(w, layout="bf16-panels")
        return
    lw = make_linear(w, layout="bf16-panels")
    got = lw(x)
    want = (x.double() @ w.double().T)
    assert got.shape == (2, rows, 200) and got.dtype == torch.bfloat16
    # one bf16 ulp, and float32's summation error where the sum cancels to near zero
    torch.testing.assert_close(got.double(), want.bfloat16().double(), atol=1e-5, rtol=2 ** -7)


def bf16_paths() -> list[str]:
    """The bfloat16 kernel's paths this CPU runs, best first (AMX tiles, AVX512-BF16): each is tested where it runs."""
    from kvpilot.kernels import cpu_extension

    here, every = cpu_extension.require().bf16_linear_isa(), ["amx", "avx512-bf16"]
    return every[every.index(here):] if here in every else []


@pytest.mark.parametrize("rows", [16, 33, 50, 64, 70])  # (50: a pass of 32 rows, one of 16, two rows on AVX512-BF16)
def test_each_path_of_the_bf16_kernel_gives_float32_sums_rounded_once_with_every_epilogue(rows):
    """Each path of the bfloat16 kernel this CPU has (AMX: whole tiles of 16 rows, the rest on AVX512-BF16; AVX512-BF16
    alone), with a bias and each epilogue (none, SiLU, x other, + other): within bfloat16's last place of a float64
    reference. The tiles take K in 32s: another K is refused on them by name (auto takes the AVX512-BF16 path)."""
    from kvpilot.kernels import cpu_extension
    from kvpilot.kernels.linear import bf16_panels

    ext = cpu_extension.require()
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(200, 576, generator=gen) * 0.05).bfloat16()  # 200 outputs: six whole panels and a part of the seventh
    x = torch.randn(rows, 600, generator=gen).bfloat16()[:, :576]  # rows with a stride of 600
    bias, other = torch.randn(200, generator=gen), torch.randn(rows, 200, generator=gen).bfloat16()
    panels = bf16_panels(w)
    if not bf16_paths():  # a CPU without AVX512-BF16: the kernel refuses by name
        with pytest.raises(RuntimeError, match="needs AVX512-BF16"):
            ext.bf16_linear(x, panels, 200, bias, 0, None, "auto")
        return
    y = x.double() @ w.double().T + bias.double()
    wants = [y, F.silu(y), y * other.double(), y + other.double()]
    for isa in [*bf16_paths(), "auto"]:
        for epilogue, want in enumerate(wants):
            got = ext.bf16_linear(x, panels, 200, bias, epilogue, other if epilogue >= 2 else None, isa)
            assert got.shape == (rows, 200) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.double(), want.bfloat16().double(), atol=1e-4, rtol=2 ** -7, msg=f"{isa}, epilogue {epilogue}")
    odd_k = (torch.randn(40, 560, generator=gen) * 0.05).bfloat16()
    if "amx" in bf16_paths():
        with pytest.raises(RuntimeError, match="K is not a multiple of 32"):
            ext.bf16_linear(x[:, :560], bf16_panels(odd_k), 40, None, 0, None, "amx")
    got = ext.bf16_linear(x[:, :560].contiguous(), bf16_panels(odd_k), 40, None, 0, None, "auto")
    torch.testing.assert_close(got.double(), (x[:, :560].double() @ odd_k.double().T).bfloat16().double(), atol=1e-4, rtol=2 ** -7)
    with pytest.raises(RuntimeError, match="isa must be auto, amx or avx512-bf16"):
        ext.bf16_linear(x, panels, 200, None, 0, None, "avx2")


def test_the_bf16_path_named_in_the_environment_is_taken_or_refused_at_load(monkeypatch):
    """KVPILOT_BF16_ISA pins the bfloat16 kernel's path: a name it does not know, or AMX where the tiles cannot take the
    projection (no AMX here, or K not whole tiles of 32), is refused when the projection is made, never in a step."""
    from kvpilot.kernels.linear import BF16_ISA_ENV, bf16_isa

    gen = torch.Generator().manual_seed(0)
    w, odd_k = (torch.randn(64, 576, generator=gen) * 0.05).bfloat16(), (torch.randn(64, 40, generator=gen) * 0.05).bfloat16()
    x = torch.randn(20, 576, generator=gen).bfloat16()
    monkeypatch.setenv(BF16_ISA_ENV, "avx2")
    with pytest.raises(ValueError, match="KVPILOT_BF16_ISA='avx2': expected one of auto, amx, avx512-bf16"):
        bf16_isa()
    if not bf16_paths():
        return  # (no AVX512-BF16: the layout itself is refused, test_bf16_panels_equal_float32_sums_rounded_once)
    monkeypatch.setenv(BF16_ISA_ENV, "amx")
    with pytest.raises(ValueError, match="KVPILOT_BF16_ISA=amx: this CPU has no AMX-BF16 tiles, or the projection's K \\(40\\)"):
        make_linear(odd_k, layout="bf16-panels")
    want = (x.double() @ w.double().T).bfloat16().double()
    for isa in bf16_paths():
        monkeypatch.setenv(BF16_ISA_ENV, isa)
        lin = make_linear(w, layout="bf16-panels")
        assert lin.isa == isa
        torch.testing.assert_close(lin(x).double(), want, atol=1e-4, rtol=2 ** -7)
    if "amx" not in bf16_paths():
        monkeypatch.setenv(BF16_ISA_ENV, "amx")
        with pytest.raises(ValueError, match="no AMX-BF16 tiles"):
            make_linear(w, layout="bf16-panels")


def test_weights_are_buffers():
    lin = make_linear(torch.randn(8, 4, dtype=torch.float64))
    assert torch.equal(lin.state_dict()["weight"], lin.weight) and lin.to(torch.float32).weight.dtype == torch.float32


def test_row_parallel_projection_counts_bias_and_residual_on_rank_0_only(tmp_path):
    """One rank's part of a row-parallel projection (a one-rank gloo group, so the all-reduce is the
    identity): rank 0's part carries the bias and the residual, any other rank's neither."""
    import torch.distributed as dist

    from kvpilot.kernels.linear import RowParallel, RowParallelLinear

    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    x, residual = torch.randn(3, 4, generator=gen), torch.randn(3, 6, generator=gen)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for layout in ("onednn", "dense"):
            first, other = (make_linear(w, bias=b, shard=RowParallel(rank), layout=layout) for rank in (0, 1))
            assert isinstance(first, RowParallelLinear) and first.local.bias is not None and other.local.bias is None
            torch.testing.assert_close(first.add(x, residual), x @ w.T + b + residual)
            torch.testing.assert_close(other.add(x, residual), x @ w.T)
            torch.testing.assert_close(first(x), x @ w.T + b)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("avx512", [False, True])
def test_a_half_dtype_on_a_cpu_without_avx512_is_warned_of(monkeypatch, caplog, avx512):
    """bfloat16 / float16 compute on a CPU without AVX-512 (an AVX2-only EPYC): no fast kernel takes the projections,
    so the engine says so at load and names the faster choice; on an AVX-512 CPU, in float32 and on a GPU it says
    nothing."""
    import logging

    from kvpilot.kernels import cpu_extension, linear
    from kvpilot.server import LLM
    from kvpilot.server.engine.worker import slow_half_projections

    flags = {"avx2", "fma", "f16c"} | ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} if avx512 else set())
    monkeypatch.setattr(cpu_extension, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(linear, "bf16_panels_available", lambda: avx512)
    cpu = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float16):
        why = slow_half_projections(cpu, dtype)
        assert (why is not None) != avx512
        assert avx512 or why.startswith(f"dtype={str(dtype)[6:]} on a CPU without AVX-512") and "--dtype float32" in why
    assert slow_half_projections(cpu, torch.float32) is None and slow_half_projections(torch.device("cuda"), torch.bfloat16) is None
    if avx512:
        return
    with caplog.at_level(logging.WARNING, logger="kvpilot"):  # the engine logs it once, at load
        LLM(model="smollm2-135m", dtype="bfloat16", num_threads=1, show_progress=False, kv_cache_memory="8MiB", max_model_len=64)
    warned = [r.getMessage() for r in caplog.records if "on a CPU without AVX-512" in r.getMessage()]
    assert len(warned) == 1, warned
