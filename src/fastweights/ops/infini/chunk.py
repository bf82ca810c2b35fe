"""Segment-parallel Infini-attention (docs/maths.md 5.2): the fast form for training and prefill.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, N segment length,
S = ceil(T / N) segments. Inputs ``[B, T, H, D]`` in the compute dtype, starting at a segment
boundary; the memory is ``M [B, H, Dk, Dv]``, ``z [B, H, Dk]``. T need not be a multiple of N:
the tail is zero-padded; padded keys sit after every real query of the last segment (so the
causal mask hides them), the last segment is then incomplete (so it is never written to the
memory), and padded outputs are dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .memory import retrieve, sigma, write


def _segments(x: torch.Tensor, N: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, S, N, D], zero-padding T up to S * N."""
    B, T, H, D = x.shape
    S = -(-T // N)
    if S * N != T:
        x = F.pad(x, (0, 0, 0, 0, 0, S * N - T))
    return x.reshape(B, S, N, H, D).permute(0, 3, 1, 2, 4).contiguous()


def _exclusive_prefix(first: torch.Tensor, per_segment: torch.Tensor) -> torch.Tensor:
    """Memory entering each segment: first + sum of per_segment over earlier segments (dim 2)."""
    return torch.cat([first.unsqueeze(2), per_segment[:, :, :-1]], dim=2).cumsum(dim=2)


def infini_attention_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_mem: torch.Tensor, k_mem: torch.Tensor,
    g: torch.Tensor, M: torch.Tensor, z: torch.Tensor, segment_len: int, update: str,
    scale: float, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All segments at once: A_dot is causal softmax attention batched over the S segments; for
    the linear update A_mem is block-causal normalised linear attention (the memory entering
    segment s is M_0 + sum_{r<s} sigma(K_r)^T V_r, an exclusive prefix sum over segments); the
    delta update needs the memory before each segment, so it scans the segments (one batched
    matmul per segment) and then retrieves for all segments at once. A = g A_mem + (1 - g) A_dot
    with g = sigmoid(gate) [H]. Returns (o [B, T, H, Dv], M, z) with the memory after the last
    complete segment (a trailing partial segment is read but not written)."""
    T = q.shape[1]
    N = segment_len
    full = T // N  # complete segments: only these are written to the memory
    qs, ks, vs = (_segments(x, N) for x in (q, k, v))  # [B, H, S, N, D]
    H, S = qs.shape[1:3]
    a_dot = F.scaled_dot_product_attention(
        qs.flatten(1, 2), ks.flatten(1, 2), vs.flatten(1, 2), is_causal=True, scale=scale,
    ).unflatten(1, (H, S))  # [B, H, S, N, Dv]

    sq = _segments(sigma(q_mem), N)  # [B, H, S, N, Dk]
    sk = _segments(sigma(k_mem), N)
    # M_in holds one memory per segment, [B, H, S, Dk, Dv]: T Dk Dv / N floats per head, no
    # more than the activations themselves once N >= Dk.
    if update == "linear":
        dM, dz = sk.transpose(-1, -2) @ vs, sk.sum(dim=3)  # [B, H, S, Dk, Dv], [B, H, S, Dk]
        M_in, z_in = _exclusive_prefix(M, dM), _exclusive_prefix(z, dz)
        # The final memory is the one entering the last segment, plus that segment if complete.
        M, z = M_in[:, :, -1], z_in[:, :, -1]
        if full == S:
            M, z = M + dM[:, :, -1], z + dz[:, :, -1]
    else:
        M_list, z_list = [], []
        for s in range(S):
            M_list.append(M)
            z_list.append(z)
            if s < full:
                M, z = write(sk[:, :, s], vs[:, :, s], M, z, update, eps)
        M_in, z_in = torch.stack(M_list, dim=2), torch.stack(z_list, dim=2)
    a_mem = retrieve(sq, M_in, z_in, eps)  # [B, H, S, N, Dv]

    gate = g[:, None, None, None]  # [H, 1, 1, 1]
    o = gate * a_mem + (1.0 - gate) * a_dot
    return o.permute(0, 2, 3, 1, 4).flatten(1, 2)[:, :T], M, z
