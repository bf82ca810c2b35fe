"""Token-by-token recurrence of the decayed linear attention (SPEC.md 3.5): the decoding form.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim.
Inputs ``[B, T, H, D]`` in the compute dtype, q already scaled; state ``S [B, H, Dk, Dv]``;
``decay`` ``[H]``.
"""

from __future__ import annotations

import torch


def decay_linear_attn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = lambda_h S_{t-1} + k_t^T v_t, o_t = q_t S_t."""
    lam = decay.view(1, -1, 1, 1)
    outs = []
    for t in range(q.shape[1]):
        S = lam * S + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        outs.append(torch.einsum("bhd,bhde->bhe", q[:, t], S))
    return torch.stack(outs, dim=1), S
