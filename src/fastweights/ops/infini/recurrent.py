"""Token-streaming Infini-attention (SPEC.md 5.2): the decoding form.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, N segment length,
n tokens of the open segment (0 <= n < N). Inputs ``[B, T, H, D]`` in the compute dtype; the
open segment's cache holds its keys (dot-product path), values and memory keys as
``[B, n, H, D]``; the memory is ``M [B, H, Dk, Dv]``, ``z [B, H, Dk]``.
"""

from __future__ import annotations

import torch

from .memory import retrieve, sigma, write


def infini_attention_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_mem: torch.Tensor, k_mem: torch.Tensor,
    g: torch.Tensor, M: torch.Tensor, z: torch.Tensor, k_seg: torch.Tensor, v_seg: torch.Tensor,
    k_mem_seg: torch.Tensor, segment_len: int, update: str, scale: float, eps: float,
) -> tuple[torch.Tensor, ...]:
    """One token at a time: append (k_t, v_t, k_mem_t) to the open segment's cache, attend over
    the cache with softmax, retrieve from the memory as it was before this segment, mix with the
    per-head gate g = sigmoid(gate) [H]; when the cache holds N tokens, fold it into (M, z) and
    clear it. Returns (o [B, T, H, Dv], M, z, k_seg, v_seg, k_mem_seg)."""
    gate = g[:, None]  # [H, 1] against [B, H, Dv]
    sq_all = sigma(q_mem)
    outs = []
    for t in range(q.shape[1]):
        k_seg = torch.cat([k_seg, k[:, t:t + 1]], dim=1)
        v_seg = torch.cat([v_seg, v[:, t:t + 1]], dim=1)
        k_mem_seg = torch.cat([k_mem_seg, k_mem[:, t:t + 1]], dim=1)
        scores = scale * torch.einsum("bhd,bjhd->bhj", q[:, t], k_seg)  # [B, H, n]
        a_dot = torch.einsum("bhj,bjhe->bhe", scores.softmax(dim=-1), v_seg)
        a_mem = retrieve(sq_all[:, t].unsqueeze(-2), M, z, eps).squeeze(-2)  # [B, H, Dv]
        outs.append(gate * a_mem + (1.0 - gate) * a_dot)
        if k_seg.shape[1] == segment_len:
            sk = sigma(k_mem_seg).transpose(1, 2)  # [B, H, N, Dk]
            M, z = write(sk, v_seg.transpose(1, 2), M, z, update, eps)
            k_seg, v_seg, k_mem_seg = k_seg[:, :0], v_seg[:, :0], k_mem_seg[:, :0]
    return torch.stack(outs, dim=1), M, z, k_seg, v_seg, k_mem_seg
