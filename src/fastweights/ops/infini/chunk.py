"""Segment-parallel Infini-attention (SPEC.md 5.2): the fast form for training and prefill.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, N segment length,
S = ceil(T / N) segments. Inputs ``[B, T, H, D]`` in the compute dtype, starting at a segment
boundary; the memory is ``M [B, H, Dk, Dv]``, ``z [B, H, Dk]``. T need not be a multiple of N:
the tail is zero-padded (after the feature map, so padded tokens write nothing), padded keys
sit after every real query of the last segment (so the causal mask hides them), and padded
outputs are dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fwp.chunk import _exclusive_prefix, _from_chunks, _to_chunks
from .memory import retrieve, write


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
    qs, ks, vs = (_to_chunks(x, N) for x in (q, k, v))  # [B, H, S, N, D]
    H, S = qs.shape[1:3]
    a_dot = F.scaled_dot_product_attention(
        qs.flatten(1, 2), ks.flatten(1, 2), vs.flatten(1, 2), is_causal=True, scale=scale,
    ).unflatten(1, (H, S))  # [B, H, S, N, Dv]

    sq = _to_chunks(F.elu(q_mem) + 1.0, N)  # [B, H, S, N, Dk]
    sk = _to_chunks(F.elu(k_mem) + 1.0, N)
    # M_in holds one memory per segment, [B, H, S, Dk, Dv]: T Dk Dv / N floats per head, no
    # more than the activations themselves once N >= Dk.
    if update == "linear":
        M_in, M_all = _exclusive_prefix(M, sk.transpose(-1, -2) @ vs)  # [B, H, S, Dk, Dv]
        z_in, z_all = _exclusive_prefix(z, sk.sum(dim=3))  # [B, H, S, Dk]
        # With a partial last segment, the final memory is the one entering it.
        M, z = (M_all, z_all) if full == S else (M_in[:, :, -1], z_in[:, :, -1])
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
    return _from_chunks(o, T), M, z
