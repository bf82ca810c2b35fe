"""Token-by-token recurrence of the delta rule (docs/maths.md 1.4): the decoding form.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim.
Inputs ``[B, T, H, D]`` in the compute dtype, q already scaled; state ``S [B, H, Dk, Dv]``.
"""

from __future__ import annotations

import torch

from .._steps import outer_add, read, stack_time


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
