"""Projections: the oneDNN packed path and the dense path against plain torch, fused forms included."""

import pytest
import torch
import torch.nn.functional as F

from kvpilot.kernels.linear import LinearWeight, linear, linear_add, linear_mul, linear_silu, onednn_available


def test_onednn_is_available_here():
    """The CPU engine's speed depends on it; CI must say so loudly when a torch build lacks it."""
    assert onednn_available()


@pytest.mark.parametrize("use_onednn", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [0, 1, 7, 64])
def test_projections_match_torch(use_onednn, dtype, tol, rows):
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(48, 40, generator=gen) * 0.1).to(dtype)
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    other = torch.randn(rows, 48, generator=gen).to(dtype)
    lw = LinearWeight.create(w, use_onednn=use_onednn)
    assert (lw.packed is not None) == use_onednn and (lw.dense is None) == use_onednn
    ref = (x.float() @ w.float().T)

    def close(got, want):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)

    close(linear(x, lw), ref)
    close(linear_silu(x, lw), F.silu(ref))
    close(linear_mul(x, lw, other), ref * other.float())
    close(linear_add(x, lw, other), ref + other.float())


def test_default_choice_follows_device_and_dtype():
    assert LinearWeight.create(torch.randn(4, 4)).packed is not None
    assert LinearWeight.create(torch.randn(4, 4, dtype=torch.float64)).dense is not None  # oneDNN: fp32/bf16 only
