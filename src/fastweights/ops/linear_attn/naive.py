"""Oracle of linear attention (the sum rule), written straight from docs/maths.md 1.3.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim.
Inputs are ``[B, T, H, D]`` in the compute dtype (float32/float64), already validated and with
q already multiplied by ``scale``; states are ``S [B, H, Dk, Dv]`` and ``z [B, H, Dk]``.
"""

from __future__ import annotations

import torch


def linear_attn_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S0: torch.Tensor, z0: torch.Tensor,
    normalize: bool, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Parallel quadratic form: Y = tril(Q K^T) V (+ Q S0), divided by tril(Q K^T) 1 (+ Q z0) + eps."""
    scores = torch.einsum("bthd,bshd->bhts", q, k).tril()  # [B, H, T, T]
    o = torch.einsum("bhts,bshe->bthe", scores, v) + torch.einsum("bthd,bhde->bthe", q, S0)
    if normalize:
        den = scores.sum(-1).transpose(1, 2) + torch.einsum("bthd,bhd->bth", q, z0)  # [B, T, H]
        o = o / (den + eps).unsqueeze(-1)
    S = S0 + torch.einsum("bthd,bthe->bhde", k, v)
    z = z0 + k.sum(1)
    return o, S, z
