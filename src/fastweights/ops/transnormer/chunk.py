"""Chunked parallel forms of the TransNormer family: decayed linear attention (docs/maths.md 3.5)
and block-diagonal attention (docs/maths.md 3.2).

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, C chunk size,
w block size, N number of chunks/blocks. Inputs ``[B, T, H, D]`` in the compute dtype (the
decay form applies its ``scale`` itself); state ``S [B, H, Dk, Dv]``; ``decay`` ``[H]``. T need not be a multiple of
C or w: the tail is zero-padded (see the comments on why padding changes nothing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._chunks import (
    _entering_states,
    _from_chunks,
    _head_slices,
    _merge_heads,
    _per_head,
    _to_chunks,
)


def decay_linear_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, S: torch.Tensor,
    chunk_size: int, scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk of L real tokens (0-based i, j inside the chunk; L = C except in a short last
    chunk): O = scale [(Q K^T ⊙ D) V + diag(lambda^{i+1}) Q S_prev] with D_ij = lambda^{i-j}
    (i >= j, else 0), S_next = lambda^L S_prev + K^T diag(lambda^{L-1-j}) V (docs/maths.md 3.5).
    Unlike the other forms, this one takes q unscaled: ``scale`` rides on
    the [H, C, C] mask and the [H, C] query weights instead of costing a pass over q.

    Every decay factor is a power lambda^e with 0 <= e <= C (never lambda^-e, which overflows
    for small lambda), and D and Λ_q are the same for every chunk: built once per call as small
    tables, never as a T x T matrix. As in the sum rule's chunk form (ops/linear_attn/chunk.py),
    every product is one batched matmul per head over all chunks, read in place from the inputs,
    and only the state hand-off between chunks is a loop."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    C = min(chunk_size, T)
    N = -(-T // C)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, decay, S))
    lam = decay.view(H, 1, 1)
    idx = torch.arange(C, device=q.device)
    gap = idx.view(C, 1) - idx.view(1, C)  # i - j
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    D = torch.where(gap >= 0, scale * lam ** gap.clamp(min=0), zero)  # [H, C, C]
    q_w = scale * lam ** (idx + 1).view(C, 1)  # [H, C, 1]
    # Value weights lambda^{L-1-j} per chunk; the exponent is clamped at 0 for padded rows
    # (j >= L), which are zero: a negative power of a tiny lambda would be inf and inf * 0 NaN.
    length = torch.full((N, 1), C, device=q.device)
    length[-1] = T - (N - 1) * C
    v_w = lam ** (length - 1 - idx).clamp(min=0)  # [H, N, C]
    chunk_decay = lam.view(1, H, 1, 1, 1) ** length.view(N, 1, 1, 1, 1)  # [N, H, 1, 1, 1]
    qs, ks, vs = (_head_slices(x, C) for x in (q, k, v))  # H x [B*N, C, D]

    def writes(h: int, out: torch.Tensor | None) -> torch.Tensor:  # K^T diag(v_w) V per chunk
        weighted = (vs[h].view(B, N, C, Dv) * v_w[h].unsqueeze(-1)).view(B * N, C, Dv)
        return torch.matmul(ks[h].transpose(-1, -2), weighted, out=out)

    U = _per_head(H, (B * N, Dk, Dv), q, grad, writes).view(H, B, N, Dk, Dv)
    S_in, S = _entering_states(S.transpose(0, 1), U, chunk_decay)  # lambda^L S + U
    S_in = S_in.view(H, B * N, Dk, Dv)

    def head(h: int, out: torch.Tensor | None) -> torch.Tensor:
        scores = qs[h] @ ks[h].transpose(-1, -2)  # [B*N, C, C]
        # In place on the fresh product unless autograd needs it intact for the decay's gradient.
        scores = scores * D[h] if D.requires_grad else scores.mul_(D[h])
        return torch.matmul(qs[h] * q_w[h], S_in[h], out=out).baddbmm_(scores, vs[h])

    o = _merge_heads(_per_head(H, (B * N, C, Dv), q, grad, head), B, T)
    return o, S.transpose(0, 1)


def block_attention_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int, scale: float, kernel: str,
) -> torch.Tensor:
    """Attention inside non-overlapping blocks of w tokens, causal within each block: cost
    O(T w D). Padded tail positions come after every real one, so the causal mask hides them
    from real queries, and their own outputs are dropped."""
    T = q.shape[1]
    w = min(block_size, T)  # one block covers everything: no need to pad up to block_size
    qc, kc, vc = (_to_chunks(x, w) for x in (q, k, v))  # [B, H, N, w, D]
    if kernel == "softmax":
        H, N = qc.shape[1:3]
        o = F.scaled_dot_product_attention(
            qc.flatten(1, 2), kc.flatten(1, 2), vc.flatten(1, 2), is_causal=True, scale=scale,
        ).unflatten(1, (H, N))
    else:
        o = (scale * (qc @ kc.transpose(-1, -2))).relu().tril() @ vc
    return _from_chunks(o, T)
