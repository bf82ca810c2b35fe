"""Oracles for the TransNormer family, written straight from docs/maths.md 3.1, 3.2 and 3.5.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, w block size.
Inputs are ``[B, T, H, D]`` in the compute dtype, already validated and with q already
multiplied by ``scale`` (decay op); states are ``S [B, H, Dk, Dv]``; ``decay`` is ``[H]``.
"""

from __future__ import annotations

import torch


def decay_linear_attn_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, S0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked quadratic form over the whole sequence (0-based i, j):
    O = (Q K^T ⊙ D) V + diag(lambda^{i+1}) Q S0 with D_ij = lambda^{i-j} (i >= j, else 0),
    S_T = lambda^T S0 + sum_j lambda^{T-1-j} k_j^T v_j."""
    T = q.shape[1]
    idx = torch.arange(T, device=q.device, dtype=q.dtype)
    lam = decay.view(-1, 1, 1)  # [H, 1, 1]
    gap = idx.view(T, 1) - idx.view(1, T)  # i - j
    D = torch.where(gap >= 0, lam ** gap.clamp(min=0), torch.zeros_like(lam))  # [H, T, T]
    scores = torch.einsum("bthd,bshd->bhts", q, k) * D
    o = torch.einsum("bhts,bshe->bthe", scores, v)
    q_decay = decay.view(1, -1) ** (idx + 1).view(-1, 1)  # [T, H] = lambda^{i+1}
    o = o + torch.einsum("bthd,bhde->bthe", q * q_decay[..., None], S0)
    k_decay = decay.view(1, -1) ** (T - 1 - idx).view(-1, 1)  # [T, H] = lambda^{T-1-j}
    S = decay.view(1, -1, 1, 1) ** T * S0 + torch.einsum("bthd,bthe->bhde", k * k_decay[..., None], v)
    return o, S


def block_attention_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int, scale: float, kernel: str,
) -> torch.Tensor:
    """Full T x T attention under the block-diagonal causal mask M_ij = (j <= i and
    floor(i/w) == floor(j/w)). ``softmax``: softmax over allowed j (T2); ``relu``:
    P = relu(logits) with disallowed entries 0, O = P V (T1, before the layer's SRMSNorm)."""
    T = q.shape[1]
    idx = torch.arange(T, device=q.device)
    blk = idx // block_size
    allowed = (idx.view(T, 1) >= idx.view(1, T)) & (blk.view(T, 1) == blk.view(1, T))  # [T, T]
    logits = scale * torch.einsum("bthd,bshd->bhts", q, k)
    if kernel == "softmax":
        p = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    else:
        p = logits.relu().masked_fill(~allowed, 0.0)
    return torch.einsum("bhts,bshe->bthe", p, v)
