"""Token-by-token recurrence of the decayed linear attention (docs/maths.md 3.5): the decoding form.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim.
Inputs ``[B, T, H, D]`` in the compute dtype, q already scaled; state ``S [B, H, Dk, Dv]``;
``decay`` ``[H]`` or None (lambda = 1).
"""

from __future__ import annotations

import torch

from .._steps import outer_add, read, stack_time


def decay_linear_attn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor | None, S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = lambda_h S_{t-1} + k_t^T v_t, o_t = q_t S_t; ``decay`` None is lambda = 1 (the
    un-normalised linear attention of NormAttention without decay, with no normaliser z to
    carry). Unchecked: NormAttention's one-token step calls it on the state it checked."""
    lam = None if decay is None else decay.view(1, -1, 1, 1)
    outs = []
    for t in range(q.shape[1]):
        S = outer_add(S if lam is None else lam * S, k[:, t], v[:, t])
        outs.append(read(q[:, t], S))
    return stack_time(outs), S
