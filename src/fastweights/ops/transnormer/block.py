"""Block-diagonal attention of TransNormer's DiagAttention (SPEC.md 3.2): ``block_attention``.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim.
"""

from __future__ import annotations

import math

import torch

from ..._checks import (
    check_choice,
    check_finite_float,
    check_positive_int,
    check_qkv,
    state_dtype,
)
from .._autocast import float32_compute
from .chunk import block_attention_chunk

KERNELS = ("softmax", "relu")


@float32_compute
def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int,
    scale: float | None = None, kernel: str = "softmax",
) -> torch.Tensor:
    """Causal attention inside non-overlapping blocks of ``block_size`` tokens (SPEC 3.2).

    q, k: [B, T, H, Dk]; v: [B, T, H, Dv] -> o [B, T, H, Dv] in q's dtype. Blocks start at
    t = 0; the last block may be shorter. logits = scale q k^T (scale defaults to 1/sqrt(Dk)),
    causal within the block, nothing crosses a block border. ``kernel="softmax"`` (TransNormer
    T2): softmax over the allowed keys. ``kernel="relu"`` (T1): O = relu(logits) V with the
    disallowed entries 0; the SRMSNorm that follows it in T1 is the layer's job.
    """
    check_qkv(q, k, v)
    check_positive_int("block_size", block_size)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    check_finite_float("scale", scale)
    check_choice("kernel", kernel, KERNELS)
    # scaled_dot_product_attention accumulates in float32 for half inputs and a softmax average
    # cannot overflow, so the softmax kernel keeps the input dtype (and the fused GPU kernels);
    # the ReLU kernel sums up to block_size unnormalised terms, so it is computed in float32.
    cdtype = q.dtype if kernel == "softmax" else state_dtype(q.dtype)
    qc, kc, vc = q.to(cdtype), k.to(cdtype), v.to(cdtype)
    return block_attention_chunk(qc, kc, vc, block_size, scale, kernel).to(q.dtype)
