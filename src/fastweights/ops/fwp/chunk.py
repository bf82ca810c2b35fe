"""Chunked parallel forms of the fast-weight family (SPEC.md 1.3 and the WY/UT form of 1.4).

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, C chunk size,
N number of chunks. Inputs ``[B, T, H, D]`` in the compute dtype with q already scaled; states
``S [B, H, Dk, Dv]``, ``z [B, H, Dk]``. T need not be a multiple of C: the tail is zero-padded,
and zero keys/values/betas write nothing, so padding never changes the state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, *rest] -> [B, H, N, C, *rest], zero-padding T up to N*C."""
    B, T, H = x.shape[:3]
    N = -(-T // C)
    x = x.movedim(1, 2)  # [B, H, T, ...]
    if N * C != T:
        pad = [0, 0] * (x.dim() - 3) + [0, N * C - T]
        x = F.pad(x, pad)
    return x.reshape(B, H, N, C, *x.shape[3:])


def _from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H, N, C, D] -> [B, T, H, D], dropping the padded tail."""
    B, H, N, C, D = x.shape
    return x.reshape(B, H, N * C, D)[:, :, :T].transpose(1, 2)


def _exclusive_prefix(first: torch.Tensor, per_chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """States entering each chunk and the final state: first + cumsum of per_chunk (dim 2)."""
    inclusive = first.unsqueeze(2) + per_chunk.cumsum(dim=2)
    entering = torch.cat([first.unsqueeze(2), inclusive[:, :, :-1]], dim=2)
    return entering, inclusive[:, :, -1]


def linear_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S0: torch.Tensor, z0: torch.Tensor,
    normalize: bool, eps: float, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Intra-chunk tril(Q_c K_c^T) V_c plus inter-chunk Q_c S_prev (and likewise for z)."""
    T = q.shape[1]
    qc, kc, vc = (_to_chunks(x, chunk_size) for x in (q, k, v))
    scores = (qc @ kc.transpose(-1, -2)).tril()  # [B, H, N, C, C]
    S_prev, S = _exclusive_prefix(S0, kc.transpose(-1, -2) @ vc)  # [B, H, N, Dk, Dv]
    o = scores @ vc + qc @ S_prev
    if normalize:
        z_prev, z = _exclusive_prefix(z0, kc.sum(dim=3))  # [B, H, N, Dk]
        den = scores.sum(-1) + (qc @ z_prev.unsqueeze(-1)).squeeze(-1)  # [B, H, N, C]
        o = o / (den + eps).unsqueeze(-1)
    else:
        z = z0 + k.sum(dim=1)
    return _from_chunks(o, T), S, z


def delta_rule_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """WY/UT form: per chunk T = (I + stril(diag(beta) K K^T))^-1 diag(beta), U = T (V - K S),
    O = Q S + tril(Q K^T) U, S <- S + K^T U. Everything but the last three lines is batched
    over all chunks; only the state hand-off is sequential."""
    T = q.shape[1]
    C = chunk_size
    qc, kc, vc = (_to_chunks(x, C) for x in (q, k, v))
    bc = _to_chunks(beta.unsqueeze(-1), C).squeeze(-1)  # [B, H, N, C]
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    A = (bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2))).tril(-1)
    # Unit lower-triangular solve: exact (no pivoting) and cheaper than an inverse.
    Tm = torch.linalg.solve_triangular(A + eye, torch.diag_embed(bc), upper=False, unitriangular=True)
    W = Tm @ kc  # [B, H, N, C, Dk]
    U0 = Tm @ vc  # [B, H, N, C, Dv]
    qk = (qc @ kc.transpose(-1, -2)).tril()
    outs = []
    for n in range(qc.shape[2]):
        U = U0[:, :, n] - W[:, :, n] @ S
        outs.append(qc[:, :, n] @ S + qk[:, :, n] @ U)
        S = S + kc[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2)
    return _from_chunks(o, T), S
