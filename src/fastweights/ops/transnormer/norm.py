"""SRMSNorm, the parameter-free simple RMS norm of TransNormer (docs/maths.md 3.1).

Dimension legend: ``...`` any leading dims, ``d`` normalised feature size.
"""

from __future__ import annotations

import math

import torch

from ..._checks import check_nonneg_float, check_tensor, state_dtype


def srms_norm(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """x / (||x||_2 / sqrt(d) + eps) over the last dim, no learnable gain. [..., d] -> [..., d].

    Computed in float32 or wider: NormAttention feeds it un-normalised sums that grow with t and
    can exceed the float16 range before the division brings them back to RMS ~1.
    """
    check_tensor("x", x)
    check_nonneg_float("eps", eps)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    xc = x.to(state_dtype(x.dtype))
    rms = xc.norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
    return (xc / (rms + eps)).to(x.dtype)
