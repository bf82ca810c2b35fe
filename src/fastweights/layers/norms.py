"""The language model's norms: ``RMSNorm`` (with a gain) and TransNormer's gain-free
``SRMSNorm`` (docs/maths.md 3.1). [..., d] -> [..., d]."""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_nonneg_float, check_positive_int, check_tensor
from ..ops.transnormer import srms_norm


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 or wider."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Mean of squares in float32 at least: bfloat16 loses the small-variance rows.
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight.to(x.dtype)


class SRMSNorm(nn.Module):
    """x / (||x||_2 / sqrt(d) + eps) over the last dim, no learnable gain (docs/maths.md 3.1).

    ``dim`` (optional) is checked against x's last dim. [..., d] -> [..., d].
    """

    def __init__(self, dim: int | None = None, eps: float = 1e-8) -> None:
        super().__init__()
        self.dim = None if dim is None else check_positive_int("dim", dim)
        self.eps = check_nonneg_float("eps", eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x)
        if self.dim is not None and (x.dim() < 1 or x.shape[-1] != self.dim):
            raise ValueError(f"x must have shape [..., {self.dim}], got {tuple(x.shape)}")
        return srms_norm(x, self.eps)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"
