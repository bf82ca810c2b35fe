"""Token-streaming Infini-attention (docs/maths.md 5.2): the decoding form.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, N segment length,
n tokens of the open segment (0 <= n < N). Inputs ``[B, T, H, D]`` in the compute dtype; the
open segment's cache holds its keys (dot-product path), values and memory keys as
``[B, n, H, D]``; the memory is ``M [B, H, Dk, Dv]``, ``z [B, H, Dk]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._modes import reads_allowed
from .._steps import stack_time
from ..softmax.attention import softmax_attention
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
        # The token attends to the whole open segment (itself the last): no mask. One fused
        # call rather than scores, softmax and product as three (a decoding step is a chain of
        # tiny operations).
        a_dot = F.scaled_dot_product_attention(
            q[:, t:t + 1].transpose(1, 2), k_seg.transpose(1, 2), v_seg.transpose(1, 2),
            scale=scale).squeeze(2)  # [B, H, Dv]
        a_mem = retrieve(sq_all[:, t].unsqueeze(-2), M, z, eps).squeeze(-2)  # [B, H, Dv]
        outs.append(torch.lerp(a_dot, a_mem, gate))  # g a_mem + (1 - g) a_dot
        if k_seg.shape[1] == segment_len:
            sk = sigma(k_mem_seg).transpose(1, 2)  # [B, H, N, Dk]
            M, z = write(sk, v_seg.transpose(1, 2), M, z, update, eps)
            k_seg, v_seg, k_mem_seg = k_seg[:, :0], v_seg[:, :0], k_mem_seg[:, :0]
    return stack_time(outs), M, z, k_seg, v_seg, k_mem_seg


def infini_attention_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_mem: torch.Tensor, k_mem: torch.Tensor,
    g: torch.Tensor, state: tuple[torch.Tensor, ...], segment_len: int, update: str,
    scale: float, eps: float,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One token per row, each row at its own place in its segment: ``state`` is (M, z, k_seg,
    v_seg, k_mem_seg [B, N - 1, H, D], fill [B]) with row b's open segment the last fill[b]
    cache entries (``InfiniRowsState``). The token joins the cache, attends over its row's
    segment (the padding before it masked), reads the memory as it was before the segment, and
    rows whose segment it completes fold that segment into their (M, z).
    Returns (o [B, 1, H, Dv], the state after the token in the same form)."""
    M, z, k_seg, v_seg, k_mem_seg, fill = state
    ks, vs, kms = (torch.cat([c, x], dim=1) for c, x in ((k_seg, k), (v_seg, v), (k_mem_seg, k_mem)))
    n = fill + 1  # [B] tokens of each row's segment, this one included
    a_dot = softmax_attention(q, ks, vs, causal=True, scale=scale, kv_lengths=n)[:, 0]
    a_mem = retrieve(sigma(q_mem[:, 0]).unsqueeze(-2), M, z, eps).squeeze(-2)  # [B, H, Dv]
    o = torch.lerp(a_dot, a_mem, g[:, None])  # g a_mem + (1 - g) a_dot
    closed = n == segment_len
    if not reads_allowed():
        # Nothing read back (a captured or traced step): every row's segment is written and
        # kept where it closes (the other rows' windows hold padding, their writes dropped).
        sk = sigma(kms).transpose(1, 2)  # [B, H, N, Dk]
        M_w, z_w = write(sk, vs.transpose(1, 2), M, z, update, eps)
        M = torch.where(closed.view(-1, 1, 1, 1), M_w, M)
        z = torch.where(closed.view(-1, 1, 1), z_w, z)
    elif bool(closed.any()):
        # Only the rows whose segment closes are written: an index of those rows, a
        # data-dependent branch (a read back to the host).
        rows = closed.nonzero().squeeze(1)
        sk = sigma(kms[rows]).transpose(1, 2)  # [r, H, N, Dk]: the whole window is the segment
        M_r, z_r = write(sk, vs[rows].transpose(1, 2), M[rows], z[rows], update, eps)
        M, z = M.index_copy(0, rows, M_r), z.index_copy(0, rows, z_r)
    return o.unsqueeze(1), (M, z, ks[:, 1:], vs[:, 1:], kms[:, 1:], n % segment_len)
