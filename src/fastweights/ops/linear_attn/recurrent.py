"""Token-by-token recurrence of linear attention (docs/maths.md 1.3): the decoding form.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim.
Inputs ``[B, T, H, D]`` in the compute dtype, q already scaled; states ``S [B, H, Dk, Dv]``,
``z [B, H, Dk]``.
"""

from __future__ import annotations

import torch

from .._steps import outer_add, read, stack_time


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
