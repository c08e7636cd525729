"""Projections: the oneDNN packed path and the dense path against plain torch, fused forms included."""

import pytest
import torch
import torch.nn.functional as F

from kvpilot.kernels.linear import make_linear, onednn_available, onednn_packs


def test_onednn_is_available_here():
    """The CPU engine's speed depends on it; CI must say so loudly when a torch build lacks it."""
    assert onednn_available()


@pytest.mark.parametrize("use_onednn", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [0, 1, 7, 64])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_projections_match_torch(use_onednn, dtype, tol, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(48, 40, generator=gen) * 0.1).to(dtype)
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    other = torch.randn(rows, 48, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype) if with_bias else None
    if use_onednn and not onednn_packs(dtype):  # bfloat16 on a CPU without AVX-512: refused by name, not a crash in oneDNN
        with pytest.raises(ValueError, match="oneDNN cannot pack torch.bfloat16"):
            make_linear(w, bias=bias, use_onednn=True)
        assert not make_linear(w, bias=bias).packed  # the default takes the dense path there
        return
    lw = make_linear(w, bias=bias, use_onednn=use_onednn)
    assert lw.packed == use_onednn and [n for n, _ in lw.named_buffers()] == ["weight", "bias"][:1 + with_bias]
    ref = (x.float() @ w.float().T) + (bias.float() if with_bias else 0)

    def close(got, want):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)

    close(lw(x), ref)
    close(lw.silu(x), F.silu(ref))
    close(lw.mul(x, other), ref * other.float())
    close(lw.add(x, other), ref + other.float())


def test_default_choice_follows_device_and_dtype():
    assert make_linear(torch.randn(4, 4)).packed
    assert not make_linear(torch.randn(4, 4, dtype=torch.float64)).packed  # oneDNN: fp32/bf16 only


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
        for use_onednn in (True, False):
            first, other = (make_linear(w, bias=b, shard=RowParallel(rank), use_onednn=use_onednn) for rank in (0, 1))
            assert isinstance(first, RowParallelLinear) and first.local.bias is not None and other.local.bias is None
            torch.testing.assert_close(first.add(x, residual), x @ w.T + b + residual)
            torch.testing.assert_close(other.add(x, residual), x @ w.T)
            torch.testing.assert_close(first(x), x @ w.T + b)
    finally:
        dist.destroy_process_group()
