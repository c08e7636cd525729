import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels import cpu_extension


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (as transformers does) and cast back."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            ext = cpu_extension.load() if x.device.type == "cpu" else None
            if ext is not None:  # one C++ pass instead of ~7 small ops
                return ext.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # bit-identical to the formula below
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
