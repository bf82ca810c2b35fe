"""Token-by-token form of the gated delta rule (SPEC.md 5b): the recurrence and its one-token
step, the decoding form.

(A file of its own beside recurrent.py while the package layout is being restructured.)

Per token, with S' = exp(g_t) S_{t-1} the decayed state:
v_bar = k_t S',  u = beta_t (v_t - v_bar),  S_t = S' + k_t^T u,  o_t = q_t S_t.

``gated_delta_rule_step`` is what ``gated_delta_rule`` runs for a one-token call (T = 1) of
mode="chunk" or "recurrent", and what a layer's decoding step calls directly on a state it has
checked (as NormAttention calls ``decay_linear_attn_recurrent``): unchecked, in the compute
dtype. A step is a chain of small operations, so it is written for few passes over the state:
one multiply (S' = exp(g) S, a new tensor, so a carried state stays valid), two batched
matrix-vector products and one fused multiply-add written into S' itself.

Dimension legend: B batch, T time, Hk query/key heads, H value heads (a multiple of Hk), Dk
key/query dim, Dv value dim. q, k ``[B, T, Hk, Dk]``, v ``[B, T, H, Dv]``, beta and g
``[B, T, H]`` in the compute dtype, q already scaled; state ``S [B, H, Dk, Dv]``.
"""

from __future__ import annotations

import torch

from .._steps import stack_time
from .gated_delta_naive import expand_heads


def _step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q, k [B, H, Dk] (already expanded to the value heads), v [B, H, Dv],
    beta, g [B, H], S [B, H, Dk, Dv] -> (o [B, H, Dv], the new state)."""
    B, H, Dk, Dv = S.shape
    S = S * torch.exp(g).view(B, H, 1, 1)  # S' (a new tensor: the carried S is left as it was)
    v_bar = torch.bmm(k.reshape(B * H, 1, Dk), S.view(B * H, Dk, Dv)).view(B, H, Dv)
    u = beta.unsqueeze(-1) * (v - v_bar)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, beta, g, S)):
        S = torch.addcmul(S, k.unsqueeze(-1), u.unsqueeze(-2))  # autograd saved S' for dk
    else:
        S.addcmul_(k.unsqueeze(-1), u.unsqueeze(-2))  # S' + k^T u, in place on the fresh S'
    o = torch.bmm(q.reshape(B * H, 1, Dk), S.view(B * H, Dk, Dv)).view(B, H, Dv)
    return o, S


def gated_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence: q, k [B, 1, Hk, Dk], v [B, 1, H, Dv], beta, g [B, 1, H],
    S [B, H, Dk, Dv] -> (o [B, 1, H, Dv], S_1). Unchecked: see the module docstring."""
    H = v.shape[2]
    o, S = _step(expand_heads(q, H)[:, 0], expand_heads(k, H)[:, 0], v[:, 0], beta[:, 0],
                 g[:, 0], S)
    return o.unsqueeze(1), S


def gated_delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over T tokens: (o [B, T, H, Dv], S_T)."""
    H = v.shape[2]
    q, k = expand_heads(q, H), expand_heads(k, H)
    outs = []
    for t in range(q.shape[1]):
        o, S = _step(q[:, t], k[:, t], v[:, t], beta[:, t], g[:, t], S)
        outs.append(o)
    return stack_time(outs), S
