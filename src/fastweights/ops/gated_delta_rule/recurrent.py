"""Token-by-token form of the gated delta rule (docs/maths.md 5b): the recurrence and its one-token
step, the decoding form.

Per token, with S' = exp(g_t) S_{t-1} the decayed state:
v_bar = k_t S',  u = beta_t (v_t - v_bar),  S_t = S' + k_t^T u,  o_t = q_t S_t.

``token_step`` is what ``gated_delta_rule`` runs for a one-token call (T = 1) of
mode="chunk" or "recurrent", and what the public ``gated_delta_rule_step`` runs once it has
checked the shapes: unchecked, in the compute dtype. A step is a chain of small operations, so it is written for few passes over the state:
one multiply (S' = exp(g) S, a new tensor, so a carried state stays valid), two batched
matrix-vector products (v - k S' in one) and the write k^T u added into S' itself.

Dimension legend: B batch, T time, Hk query/key heads, H value heads (a multiple of Hk), Dk
key/query dim, Dv value dim. q, k ``[B, T, Hk, Dk]``, v ``[B, T, H, Dv]``, beta and g
``[B, T, H]`` in the compute dtype, q already scaled; state ``S [B, H, Dk, Dv]``.
"""

from __future__ import annotations

import torch

from .._steps import stack_time
from .naive import expand_heads


def token_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence: q, k [B, 1, Hk, Dk], v [B, 1, H, Dv], beta, g [B, 1, H],
    S [B, H, Dk, Dv] -> (o [B, 1, H, Dv], S_1). Unchecked: see the module docstring.

    With T = 1 the inputs are already rows of the batched products: [B, 1, H, D] is [B H, 1, D]
    in memory, so the reshapes below are views (copies only for a strided slice)."""
    B, _, H, Dv = v.shape
    Dk = q.shape[-1]
    q, k = expand_heads(q, H), expand_heads(k, H)
    kr = k.reshape(B * H, 1, Dk)
    # S' = exp(g) S: a new tensor, so the carried S is left as it was.
    Sd = S.reshape(B * H, Dk, Dv) * torch.exp(g).reshape(B * H, 1, 1)
    u = torch.baddbmm(v.reshape(B * H, 1, Dv), kr, Sd, alpha=-1)  # v - k S'
    u = u * beta.reshape(B * H, 1, 1)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, beta, g, S)):
        Sd = torch.baddbmm(Sd, kr.transpose(1, 2), u)  # autograd saved S' for dk
    else:
        Sd.baddbmm_(kr.transpose(1, 2), u)  # S' + k^T u, in place on the fresh S'
    o = torch.bmm(q.reshape(B * H, 1, Dk), Sd)
    return o.view(B, 1, H, Dv), Sd.view(B, H, Dk, Dv)


def gated_delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over T tokens, one ``token_step`` each: (o [B, T, H, Dv], S_T)."""
    H = v.shape[2]
    q, k = expand_heads(q, H), expand_heads(k, H)
    outs = []
    for t in range(q.shape[1]):
        o, S = token_step(*(x[:, t:t + 1] for x in (q, k, v, beta, g)), S)
        outs.append(o[:, 0])
    return stack_time(outs), S
