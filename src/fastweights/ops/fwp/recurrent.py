"""Token-by-token recurrences of the fast-weight family (docs/maths.md 1.3-1.4): the decoding form.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim.
Inputs ``[B, T, H, D]`` in the compute dtype, q already scaled; states ``S [B, H, Dk, Dv]``,
``z [B, H, Dk]``.
"""

from __future__ import annotations

import torch

from .._steps import stack_time


def outer_add(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """S + k^T v per batch row and head: S [B, H, Dk, Dv], k [B, H, Dk], v [B, H, Dv] ->
    [B, H, Dk, Dv], a new tensor (S is left as it was: a carried state stays valid)."""
    # One fused pass over S (read S, write the sum): a decoding step is a handful of tiny
    # operations, and the broadcast product's own [B, H, Dk, Dv] tensor would be one more.
    return torch.addcmul(S, k.unsqueeze(-1), v.unsqueeze(-2))


def read(q: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """q S per batch row and head: q [B, H, Dk], S [B, H, Dk, Dv] -> [B, H, Dv]."""
    B, H, Dk, Dv = S.shape
    return torch.bmm(q.reshape(B * H, 1, Dk), S.reshape(B * H, Dk, Dv)).view(B, H, Dv)


def linear_attn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor, z: torch.Tensor,
    normalize: bool, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W_t = W_{t-1} + k_t^T v_t, z_t = z_{t-1} + k_t; o_t = q_t W_t [/ (q_t . z_t + eps)]."""
    outs = []
    for t in range(q.shape[1]):
        qt, kt = q[:, t], k[:, t]  # [B, H, D]
        S = outer_add(S, kt, v[:, t])
        o = read(qt, S)
        if normalize:
            z = z + kt
            o = o / ((qt * z).sum(-1, keepdim=True) + eps)
        outs.append(o)
    if not normalize:
        z = z + k.sum(1)
    return stack_time(outs), S, z


def delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Retrieve v_bar = k_t S, write S += k_t^T beta_t (v_t - v_bar), then read o_t = q_t S."""
    outs = []
    for t in range(q.shape[1]):
        kt = k[:, t]
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - read(kt, S))
        S = outer_add(S, kt, u)
        outs.append(read(q[:, t], S))
    return stack_time(outs), S
