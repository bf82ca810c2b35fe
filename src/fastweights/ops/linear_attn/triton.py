"""Linear attention (docs/maths.md 1.3) in the delta rule's Triton kernels with ``HAS_W`` off
(ops/delta_rule/triton.py: linear attention is the delta rule with W = 0 and U0 = V).
Normalised linear attention runs as the unnormalised one with a column of ones appended to V
and divides by it in PyTorch. Imports ``triton`` at import time.
"""

from __future__ import annotations

import torch

from ..delta_rule.triton import _FastWeightsTriton, _prepare, _unpad, supports

__all__ = ["linear_attn_triton", "supports"]


def linear_attn_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S0: torch.Tensor, z0: torch.Tensor,
    normalize: bool, eps: float, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked linear attention (docs/maths.md 1.3) in the delta rule's kernels; see
    ``chunk.linear_attn_chunk``.

    q (scaled), k [B, T, H, Dk], v [B, T, H, Dv] in float16/bfloat16/float32; S0 [B, H, Dk, Dv]
    and z0 [B, H, Dk] float32; chunk_size <= 64, Dk <= 128. Returns (o [B, T, H, Dv] in q's
    dtype, S, z in float32). With ``normalize`` V gains a column of ones whose state is z."""
    B, T, H, _ = q.shape
    Dv = v.shape[-1]
    S0, z0 = S0.to(torch.float32), z0.to(torch.float32)
    if normalize:
        v = torch.cat([v, v.new_ones(B, T, H, 1)], dim=-1)
        S0 = torch.cat([S0, z0.unsqueeze(-1)], dim=-1)
    (qp, kp, vp), S0p, dims = _prepare(q, k, v, S0)
    o, S = _FastWeightsTriton.apply(qp, kp, vp, None, S0p, chunk_size,
                                    torch.float32 if normalize else q.dtype)
    o, S = _unpad(o, S, dims)
    if normalize:
        o = (o[..., :Dv] / (o[..., Dv:] + eps)).to(q.dtype)
        return o, S[..., :Dv], S[..., Dv]
    return o, S, z0 + k.to(torch.float32).sum(dim=1)
