"""Chunked parallel form of linear attention (docs/maths.md 1.3).

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, C chunk size,
N number of chunks. Inputs ``[B, T, H, D]`` in the compute dtype with q already scaled; states
``S [B, H, Dk, Dv]``, ``z [B, H, Dk]``. T need not be a multiple of C: the tail is zero-padded,
and zero keys/values write nothing. ``products``: as in ops/_chunks.py.
"""

from __future__ import annotations

import torch

from .._chunks import _entering_states, _head_slices, _low, _matmul, _merge_heads, _per_head


def linear_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S0: torch.Tensor, z0: torch.Tensor,
    normalize: bool, eps: float, chunk_size: int, products: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Intra-chunk tril(Q_c K_c^T) V_c plus inter-chunk Q_c S_prev; with ``normalize`` the
    denominator is q_t . z_prev + the row sum of tril(Q_c K_c^T) (the same scores).

    Per head, each product is one batched matmul over all chunks, read in place from the
    [B, T, H, D] inputs (``_head_slices``); only the prefix sum of the chunk states is a loop.
    With ``products`` (bfloat16) the four products (K^T V, Q K^T, scores V, Q S_prev) take
    bfloat16 operands; the chunk states are summed in float32, and the denominator is
    q_t . z_t with z_t = z_prev + the running key sum, all float32 (the scores it would
    otherwise sum are bfloat16-rounded)."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    C = chunk_size
    N = -(-T // C)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, S0, z0))
    qs, ks, vs = (_head_slices(x, C) for x in (q, k, v))  # H x [B*N, C, D]
    # The product operands (the same slices without ``products``): converted once, here.
    ql, kl, vl = (qs, ks, vs) if products is None else (
        _head_slices(x.to(products), C) for x in (q, k, v))
    U = _per_head(H, (B * N, Dk, Dv), q, grad,  # each chunk's K^T V
                  lambda h, out: _matmul(kl[h].transpose(-1, -2), vl[h], out=out))
    S_in, S = _entering_states(S0.transpose(0, 1), U.view(H, B, N, Dk, Dv))
    S_in = S_in.view(H, B * N, Dk, Dv)
    S_inl = _low(S_in, products)
    if normalize:
        z_per = torch.stack([kh.sum(dim=1) for kh in ks]).view(H, B, N, Dk)  # chunk key sums
        z_in, z = _entering_states(z0.transpose(0, 1), z_per)
        z_in = z_in.view(H, B * N, 1, Dk)

    def head(h: int, out: torch.Tensor | None) -> torch.Tensor:
        scores = (ql[h] @ kl[h].transpose(-1, -2)).tril_()  # [B*N, C, C]
        if products is None:
            # Q S_prev + tril(Q K^T) V, accumulated in place: baddbmm into a separate output
            # would first copy its addend there.
            o = torch.matmul(qs[h], S_in[h], out=out).baddbmm_(scores, vs[h])
        else:  # both terms widened to float32 before they are added
            o = _matmul(ql[h], S_inl[h], out=out).add_(scores @ vl[h])
        if not normalize:
            return o
        if products is None:
            # q . z_prev as a product and a sum: a [C, Dk] x [Dk, 1] matmul per chunk is slower.
            den = (qs[h] * z_in[h]).sum(dim=-1, keepdim=True) + scores.sum(dim=-1, keepdim=True)
        else:
            den = (qs[h] * (z_in[h] + ks[h].cumsum(dim=1))).sum(dim=-1, keepdim=True)
        return o.div_(den.add_(eps)) if out is not None else o / (den + eps)

    o = _merge_heads(_per_head(H, (B * N, C, Dv), q, grad, head), B, T)
    S = S.transpose(0, 1)
    z = z.transpose(0, 1) if normalize else z0 + k.sum(dim=1)
    return o, S, z
