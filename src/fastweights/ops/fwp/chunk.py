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


def _chunk_major(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, D] -> [N, B*H, C, D] (one copy), zero-padding T up to N*C. Chunk-major so that
    each chunk of the sequential state hand-off is one contiguous batch of matrices."""
    B, T, H, D = x.shape
    N = -(-T // C)
    if N * C != T:
        x = F.pad(x, (0, 0, 0, 0, 0, N * C - T))
    return x.reshape(B, N, C, H, D).permute(1, 0, 3, 2, 4).reshape(N, B * H, C, D)


def _from_chunk_major(x: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[N, B*H, C, D] -> [B, T, H, D] (a view), dropping the padded tail."""
    N, BH, C, D = x.shape
    H = BH // B
    return x.reshape(N, B, H, C, D).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, D)[:, :T]


def _exclusive_prefix(
    first: torch.Tensor, per_chunk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """States entering each chunk and the final state: first + cumsum of per_chunk (dim 2).
    The exclusive sum is the cumsum of [first, per_chunk[:-1]]: one copy and one scan."""
    entering = torch.cat([first.unsqueeze(2), per_chunk[:, :, :-1]], dim=2).cumsum(dim=2)
    return entering, entering[:, :, -1] + per_chunk[:, :, -1]


def linear_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S0: torch.Tensor, z0: torch.Tensor,
    normalize: bool, eps: float, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Intra-chunk tril(Q_c K_c^T) V_c plus inter-chunk Q_c S_prev (and likewise for z).

    With ``normalize`` the normaliser rides along as an extra value column of ones: z is then
    the last column of the augmented state [S | z] and the denominator the last output column,
    so one set of matmuls and one prefix scan serve both."""
    T, Dv = q.shape[1], v.shape[-1]
    if normalize:
        v = F.pad(v, (0, 1), value=1.0)
        S0 = torch.cat([S0, z0.unsqueeze(-1)], dim=-1)  # [B, H, Dk, Dv + 1]
    qc, kc, vc = (_to_chunks(x, chunk_size) for x in (q, k, v))
    # tril_ in place on a fresh matmul output: autograd keeps qc and kc, not this product.
    scores = (qc @ kc.transpose(-1, -2)).tril_()  # [B, H, N, C, C]
    S_prev, S = _exclusive_prefix(S0, kc.transpose(-1, -2) @ vc)  # [B, H, N, Dk, Dv(+1)]
    # o = Q S_prev + scores V as one fused multiply-add over all (batch, head, chunk) matrices.
    o = torch.baddbmm((qc @ S_prev).flatten(0, 2), scores.flatten(0, 2), vc.flatten(0, 2))
    o = o.unflatten(0, qc.shape[:3])
    if normalize:
        o = o[..., :Dv] / (o[..., Dv:] + eps)
        S, z = S[..., :Dv], S[..., Dv]
    else:
        z = z0 + k.sum(dim=1)
    return _from_chunks(o, T), S, z


def delta_rule_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """WY/UT form (SPEC 1.4): per chunk, with A = stril(diag(beta) K K^T) and
    Tm = (I + A)^-1 diag(beta), W = Tm K and U0 = Tm V (batched over all chunks); then
    sequentially U = U0 - W S, S <- S + K^T U (two fused multiply-adds per chunk, the only
    Python loop); finally, batched again, O = Q S_entering + tril(Q K^T) U."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    C = chunk_size
    qc, kc, vc = (_chunk_major(x, C) for x in (q, k, v))  # [N, B*H, C, D]
    bc = _chunk_major(beta.unsqueeze(-1), C)  # [N, B*H, C, 1]
    # Only the strictly lower triangle of A is read (unitriangular: the diagonal is taken as 1),
    # so neither the mask nor the identity is ever built. No pivoting: the solve is exact.
    # Solving for the C x C matrix Tm and then multiplying is faster on CPU than solving for
    # [W | U0] directly (measured: LAPACK's batched trsm is slower than bmm per FLOP).
    A = bc * (kc @ kc.transpose(-1, -2))
    Tm = torch.linalg.solve_triangular(A, torch.diag_embed(bc.squeeze(-1)), upper=False,
                                       unitriangular=True)
    W, U0 = Tm @ kc, Tm @ vc  # [N, B*H, C, Dk], [N, B*H, C, Dv]
    S = S.reshape(B * H, Dk, Dv)
    entering, Us = [], []
    for n in range(qc.shape[0]):
        U = torch.baddbmm(U0[n], W[n], S, alpha=-1)  # U0 - W S
        entering.append(S)
        S = torch.baddbmm(S, kc[n].transpose(-1, -2), U)  # S + K^T U
        Us.append(U)
    S_in, U = torch.stack(entering), torch.stack(Us)  # [N, B*H, Dk, Dv], [N, B*H, C, Dv]
    qk = (qc @ kc.transpose(-1, -2)).tril_()  # in place on a fresh product (autograd-safe)
    o = torch.baddbmm((qc @ S_in).flatten(0, 1), qk.flatten(0, 1), U.flatten(0, 1))
    o = o.unflatten(0, qc.shape[:2])  # Q S_entering + tril(Q K^T) U
    return _from_chunk_major(o, B, T), S.reshape(B, H, Dk, Dv)
