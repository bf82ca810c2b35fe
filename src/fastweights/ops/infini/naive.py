"""Oracle of Infini-attention, written straight from docs/maths.md 5.1: a literal loop over
segments.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, N segment length,
n tokens of one segment (n = N except possibly the last one).
Inputs are ``[B, T, H, D]`` in the compute dtype (float32/float64), already validated, starting
at a segment boundary; ``g = sigmoid(gate)`` is ``[H]``; the memory is ``M [B, H, Dk, Dv]``,
``z [B, H, Dk]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def infini_attention_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_mem: torch.Tensor, k_mem: torch.Tensor,
    g: torch.Tensor, M: torch.Tensor, z: torch.Tensor, segment_len: int, update: str,
    scale: float, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per segment s: A_dot = causal softmax(scale Q_s K_s^T) V_s; A_mem = s(Q_s) M / s(Q_s) z
    with the memory from before the segment (s = ELU+1, denominator clamped at eps so an empty
    memory retrieves 0); A = g A_mem + (1 - g) A_dot; then, only once the segment is complete,
    M += s(K_s)^T V_s ("linear") or s(K_s)^T (V_s - s(K_s) M / s(K_s) z) ("delta"),
    z += sum_t s(k_t). Returns (o [B, T, H, Dv], M, z); a trailing partial segment is read but
    not written to the memory."""
    T = q.shape[1]
    gate = g[:, None, None]  # [H, 1, 1] against [B, H, n, Dv]
    outs = []
    for start in range(0, T, segment_len):
        seg = slice(start, min(start + segment_len, T))
        Qs, Ks, Vs = q[:, seg], k[:, seg], v[:, seg]  # [B, n, H, D]
        n = Qs.shape[1]
        scores = scale * torch.einsum("bihd,bjhd->bhij", Qs, Ks)  # [B, H, n, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        attn = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        a_dot = torch.einsum("bhij,bjhe->bhie", attn, Vs)  # [B, H, n, Dv]

        sq = F.elu(q_mem[:, seg]) + 1.0  # [B, n, H, Dk]
        num = torch.einsum("bihd,bhde->bhie", sq, M)
        den = torch.einsum("bihd,bhd->bhi", sq, z).clamp_min(eps)
        a_mem = num / den.unsqueeze(-1)

        outs.append((gate * a_mem + (1.0 - gate) * a_dot).transpose(1, 2))
        if n == segment_len:
            sk = F.elu(k_mem[:, seg]) + 1.0
            write = Vs
            if update == "delta":
                old = torch.einsum("bihd,bhde->bihe", sk, M)
                old_den = torch.einsum("bihd,bhd->bih", sk, z).clamp_min(eps)
                write = Vs - old / old_den.unsqueeze(-1)
            M = M + torch.einsum("bihd,bihe->bhde", sk, write)
            z = z + sk.sum(dim=1)
    return torch.cat(outs, dim=1), M, z
