"""Token-by-token recurrences of the fast-weight family (SPEC.md 1.3-1.4): the decoding form.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim.
Inputs ``[B, T, H, D]`` in the compute dtype, q already scaled; states ``S [B, H, Dk, Dv]``,
``z [B, H, Dk]``.
"""

from __future__ import annotations

import torch


def linear_attn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor, z: torch.Tensor,
    normalize: bool, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W_t = W_{t-1} + k_t^T v_t, z_t = z_{t-1} + k_t; o_t = q_t W_t [/ (q_t . z_t + eps)]."""
    outs = []
    for t in range(q.shape[1]):
        qt, kt, vt = q[:, t], k[:, t], v[:, t]  # [B, H, D]
        S = S + kt.unsqueeze(-1) * vt.unsqueeze(-2)
        o = torch.einsum("bhd,bhde->bhe", qt, S)
        if normalize:
            z = z + kt
            o = o / ((qt * z).sum(-1, keepdim=True) + eps)
        outs.append(o)
    if not normalize:
        z = z + k.sum(1)
    return torch.stack(outs, dim=1), S, z


def delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Retrieve v_bar = k_t S, write S += k_t^T beta_t (v_t - v_bar), then read o_t = q_t S."""
    outs = []
    for t in range(q.shape[1]):
        qt, kt, vt = q[:, t], k[:, t], v[:, t]
        v_old = torch.einsum("bhd,bhde->bhe", kt, S)
        u = beta[:, t].unsqueeze(-1) * (vt - v_old)
        S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhd,bhde->bhe", qt, S))
    return torch.stack(outs, dim=1), S
