"""The compressive memory of Infini-attention (docs/maths.md 5.1 steps 1-2), shared by the streaming
and the segment-parallel forms.

Dimension legend: B batch, H heads, n tokens, Dk key/query dim, Dv value dim; ``...`` any
leading dims (e.g. [B, H] or [B, H, S] with S segments). Memory: ``M [..., Dk, Dv]``,
``z [..., Dk]``; features ``[..., n, Dk]`` are already passed through sigma = ELU+1.
"""

from __future__ import annotations

import torch

from ..feature_maps import elu_plus_one


def sigma(x: torch.Tensor) -> torch.Tensor:
    """The memory's feature map, ELU + 1 (docs/maths.md 5.1), elementwise and > 0."""
    return elu_plus_one(x)


def retrieve(sq: torch.Tensor, M: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    """A_mem = sigma(q) M / (sigma(q) . z): [..., n, Dk] -> [..., n, Dv].

    The denominator is clamped at eps (not shifted by it): an empty memory (M = 0, z = 0) gives
    exactly 0, and a filled one (sigma > 0, so sigma(q) . z > 0) gives the exact ratio."""
    den = (sq @ z.unsqueeze(-1)).clamp_min(eps)  # [..., n, 1]
    return (sq @ M) / den


def write(
    sk: torch.Tensor, v: torch.Tensor, M: torch.Tensor, z: torch.Tensor, update: str, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one complete segment (sigma(K) [..., n, Dk], V [..., n, Dv]) into (M, z).

    "linear": M += sigma(K)^T V; "delta": M += sigma(K)^T (V - retrieve(sigma(K), M, z)), the
    retrieval using the memory before this segment (0 while it is empty). z += sum sigma(K)."""
    if update == "delta":
        v = v - retrieve(sk, M, z, eps)
    return M + sk.transpose(-1, -2) @ v, z + sk.sum(dim=-2)
