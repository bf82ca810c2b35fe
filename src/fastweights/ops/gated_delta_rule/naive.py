"""Oracle of the gated delta rule (Gated DeltaNet, docs/maths.md 5b), written straight from the
recurrence: one token at a time, the state decayed, then erased along k_t and written.

Dimension legend: B batch, T time, Hk query/key heads, H value heads (a multiple of Hk), Dk
key/query dim, Dv value dim. Inputs are in the compute dtype (float32/float64), already
validated, q already multiplied by ``scale``; q, k ``[B, T, Hk, Dk]``, v ``[B, T, H, Dv]``,
beta and g ``[B, T, H]``; the state is ``S [B, H, Dk, Dv]``.
"""

from __future__ import annotations

import torch


def expand_heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """q or k [B, T, Hk, D] -> [B, T, H, D] for H value heads: value head h reads key head
    h // (H / Hk), as transformers' Qwen3.5 / Qwen3-Next ``repeat_interleave`` does (each key
    head serves H / Hk consecutive value heads). x itself when Hk == H."""
    Hk = x.shape[2]
    return x if Hk == H else x.repeat_interleave(H // Hk, dim=2)


def gated_delta_rule_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    S0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token loop of S_t = exp(g_t) (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t and
    o_t = q_t S_t (row vectors; docs/maths.md 5b writes the same with column vectors)."""
    H = v.shape[2]
    q, k = expand_heads(q, H), expand_heads(k, H)
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    S = S0
    outs = []
    for t in range(q.shape[1]):
        kt, vt, qt = k[:, t], v[:, t], q[:, t]  # [B, H, D]
        bt, at = beta[:, t, :, None, None], torch.exp(g[:, t, :, None, None])
        kk = kt.unsqueeze(-1) * kt.unsqueeze(-2)  # [B, H, Dk, Dk] = k^T k
        S = at * ((eye - bt * kk) @ S) + bt * (kt.unsqueeze(-1) * vt.unsqueeze(-2))
        outs.append(torch.einsum("bhd,bhde->bhe", qt, S))
    return torch.stack(outs, dim=1), S
