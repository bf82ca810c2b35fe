"""Block-diagonal attention of TransNormer's DiagAttention (docs/maths.md 3.2): ``block_attention``,
and ``open_block_attention``, its last row for rows at different places in their blocks.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._checks import (
    check_arg,
    check_choice,
    check_finite_float,
    check_positive_int,
    check_qkv,
    check_tensor,
    state_dtype,
)
from .._autocast import float32_compute
from ..softmax.attention import check_kv_lengths, softmax_attention
from .chunk import block_attention_chunk

KERNELS = ("softmax", "relu")


@float32_compute
def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int,
    scale: float | None = None, kernel: str = "softmax",
) -> torch.Tensor:
    """Causal attention inside non-overlapping blocks of ``block_size`` tokens (docs/maths.md 3.2).

    q, k: [B, T, H, Dk]; v: [B, T, H, Dv] -> o [B, T, H, Dv] in q's dtype. Blocks start at
    t = 0; the last block may be shorter. logits = scale q k^T (scale defaults to 1/sqrt(Dk)),
    causal within the block, nothing crosses a block border. ``kernel="softmax"`` (TransNormer
    T2): softmax over the allowed keys. ``kernel="relu"`` (T1): O = relu(logits) V with the
    disallowed entries 0; the SRMSNorm that follows it in T1 is the layer's job.
    """
    check_qkv(q, k, v)
    check_positive_int("block_size", block_size)
    if scale is None:
        # q.shape[-1] ** -0.5, not math.sqrt: a symbolic head size under torch.compile stays
        # traceable (the default needs no finiteness check).
        scale = q.shape[-1] ** -0.5
    else:
        check_finite_float("scale", scale)
    check_choice("kernel", kernel, KERNELS)
    # scaled_dot_product_attention accumulates in float32 for half inputs and a softmax average
    # cannot overflow, so the softmax kernel keeps the input dtype (and the fused GPU kernels);
    # the ReLU kernel sums up to block_size unnormalised terms, so it is computed in float32.
    cdtype = q.dtype if kernel == "softmax" else state_dtype(q.dtype)
    qc, kc, vc = q.to(cdtype), k.to(cdtype), v.to(cdtype)
    return block_attention_chunk(qc, kc, vc, block_size, scale, kernel).to(q.dtype)


@float32_compute
def open_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None = None, *,
    scale: float | None = None, kernel: str = "softmax",
) -> torch.Tensor:
    """``block_attention``'s last row of each open block: one query per row against its block
    so far (DiagAttention's decoding step).

    q: [B, 1, H, Dk]; k: [B, L, H, Dk], v: [B, L, H, Dv], the query's own key last. With
    ``lengths`` (long [B] in [1, L]; rows at different places in their blocks, streams decoded
    together) row b's block is the last ``lengths[b]`` entries, the entries before are padding,
    never seen; None: every row's block is all L entries (no mask, and nothing read back to the
    host). Returns o [B, 1, H, Dv] in q's dtype, the kernels and ``scale`` as in
    ``block_attention``.
    """
    check_tensor("q", q, 4, "[B, 1, H, Dk]")
    B, _, H, Dk = q.shape
    check_arg("q", q, (B, 1, H, Dk), "[B, 1, H, Dk]", q)
    check_arg("k", k, (B, None, H, Dk), "[B, L, H, Dk]", q)
    check_arg("v", v, (B, k.shape[1], H, None), "[B, L, H, Dv]", q)
    check_choice("kernel", kernel, KERNELS)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    else:
        check_finite_float("scale", scale)
    L = k.shape[1]
    if lengths is None:
        return attend_open_block(q, k, v, scale, kernel)
    check_kv_lengths(lengths, B, 1, L, q.device)
    if kernel == "softmax":
        return softmax_attention(q, k.to(q.dtype), v.to(q.dtype), causal=True, scale=scale,
                                 kv_lengths=lengths)
    cdtype = state_dtype(q.dtype)  # unnormalised sums, as in block_attention
    logits = scale * torch.einsum("bqhd,bkhd->bhqk", q.to(cdtype), k.to(cdtype))
    padding = torch.arange(L, device=q.device) < (L - lengths).view(-1, 1, 1, 1)
    weights = torch.relu(logits).masked_fill(padding, 0.0)  # [B, H, 1, L]
    return torch.einsum("bhqk,bkhe->bqhe", weights, v.to(cdtype)).to(q.dtype)


def attend_open_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      kernel: str) -> torch.Tensor:
    """``block_attention``'s row for one query per row against its whole open block so far, the
    query's own key last: no mask (``open_block_attention`` without lengths). Unchecked: q
    [B, 1, H, Dk], k [B, L, H, Dk], v [B, L, H, Dv]. Returns [B, 1, H, Dv] in q's dtype,
    computed as ``block_attention`` computes each kernel (the ReLU kernel's sums in float32 or
    wider)."""
    if kernel == "softmax":  # in the input dtype, as block_attention
        k, v = (t if t.dtype == q.dtype else t.to(q.dtype) for t in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), scale=scale)
        return o.transpose(1, 2)
    cdtype = state_dtype(q.dtype)  # unnormalised sums in float32 or wider
    qc, k, v = (t if t.dtype == cdtype else t.to(cdtype) for t in (q, k, v))
    weights = torch.relu(scale * torch.einsum("bqhd,bkhd->bhqk", qc, k))  # [B, H, 1, L]
    o = torch.einsum("bhqk,bkhe->bqhe", weights, v)
    return o if o.dtype == q.dtype else o.to(q.dtype)
