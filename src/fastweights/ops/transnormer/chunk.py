"""Chunked parallel forms of the TransNormer family: decayed linear attention (SPEC.md 3.5) and
block-diagonal attention (SPEC.md 3.2).

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, C chunk size,
w block size, N number of chunks/blocks. Inputs ``[B, T, H, D]`` in the compute dtype, q already
scaled (decay op); state ``S [B, H, Dk, Dv]``; ``decay`` ``[H]``. T need not be a multiple of
C or w: the tail is zero-padded (see the comments on why padding changes nothing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fwp.chunk import _from_chunks, _to_chunks


def decay_linear_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, S: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk (0-based i, j inside the chunk, G_i = log-decay accumulated up to token i):
    O = (Q K^T ⊙ D) V + diag(e^{G_i}) Q S_prev with D_ij = e^{G_i - G_j} = lambda^{i-j} (i >= j),
    S_next = e^{G_last} S_prev + (diag(e^{G_last - G_j}) K)^T V. For a full chunk these are
    SPEC 3.5's Λ_q = lambda^{i+1}, Λ_k = lambda^{C-1-j} and lambda^C; only the state hand-off
    between chunks is sequential."""
    T, H = q.shape[1:3]
    C = min(chunk_size, T)
    qc, kc, vc = (_to_chunks(x, C) for x in (q, k, v))  # [B, H, N, C, D]
    N = qc.shape[2]
    # G counts only real tokens: the zero-padded tail must neither decay the final state nor
    # shift the key weights of the last chunk (zero keys alone would not prevent either).
    real = (torch.arange(N * C, device=q.device) < T).to(q.dtype).view(N, C)
    G = decay.log().view(H, 1, 1) * real.cumsum(dim=-1)  # [H, N, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # Mask before exp: for j > i the exponent G_i - G_j is >= 0 and could overflow.
    D = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [H, N, C, C]
    G_last = G[..., -1:]  # [H, N, 1]
    o = ((qc @ kc.transpose(-1, -2)) * D) @ vc  # [B, H, N, C, Dv]
    U = (kc * (G_last - G).exp().unsqueeze(-1)).transpose(-1, -2) @ vc  # [B, H, N, Dk, Dv]
    chunk_decay = G_last.exp().view(H, N, 1, 1)
    entering = []
    for n in range(N):
        entering.append(S)
        S = chunk_decay[:, n] * S + U[:, :, n]
    o = o + (qc * G.exp().unsqueeze(-1)) @ torch.stack(entering, dim=2)
    return _from_chunks(o, T), S


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
