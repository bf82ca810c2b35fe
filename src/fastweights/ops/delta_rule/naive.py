"""Oracles of the delta rule, written straight from docs/maths.md 1.4: ``delta_rule_naive`` and,
with attention normalisation, ``delta_rule_attn_norm_naive``.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim.
Inputs are ``[B, T, H, D]`` in the compute dtype (float32/float64), already validated and with
q already multiplied by ``scale``; states are ``S [B, H, Dk, Dv]`` and ``z [B, H, Dk]``.
"""

from __future__ import annotations

import torch


def delta_rule_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token loop of S_t = (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t; o_t = q_t S_t."""
    dk = k.shape[-1]
    eye = torch.eye(dk, dtype=k.dtype, device=k.device)
    S = S0
    outs = []
    for t in range(q.shape[1]):
        kt, vt, qt, bt = k[:, t], v[:, t], q[:, t], beta[:, t, :, None, None]  # [B,H,D]
        kk = kt.unsqueeze(-1) * kt.unsqueeze(-2)  # [B, H, Dk, Dk] = k^T k
        S = (eye - bt * kk) @ S + bt * (kt.unsqueeze(-1) * vt.unsqueeze(-2))
        outs.append(torch.einsum("bhd,bhde->bhe", qt, S))
    return torch.stack(outs, dim=1), S


def delta_rule_attn_norm_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S0: torch.Tensor,
    z0: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token loop of the delta rule with attention normalisation (the fast weight paper's eqs.
    26-27, lmtool's "Norm" variant; docs/maths.md 1.4): v_bar_t = k_t S_{t-1} / (k_t . z_{t-1})
    (0 where k_t . z_{t-1} = 0), S_t = S_{t-1} + beta_t k_t^T (v_t - v_bar_t), z_t = z_{t-1} + k_t,
    o_t = q_t S_t / (q_t . z_t + eps)."""
    S, z = S0, z0
    outs = []
    for t in range(q.shape[1]):
        kt, vt, qt, bt = k[:, t], v[:, t], q[:, t], beta[:, t, :, None]  # [B, H, D]
        den = (kt * z).sum(-1, keepdim=True)  # [B, H, 1]
        read = torch.einsum("bhd,bhde->bhe", kt, S)
        v_bar = torch.where(den > 0, read / torch.where(den > 0, den, torch.ones_like(den)), 0.0)
        S = S + kt.unsqueeze(-1) * (bt * (vt - v_bar)).unsqueeze(-2)
        z = z + kt
        num = torch.einsum("bhd,bhde->bhe", qt, S)
        outs.append(num / ((qt * z).sum(-1, keepdim=True) + eps))
    return torch.stack(outs, dim=1), S, z
