"""Causal depthwise convolution over time, shared by the layers with short convolutions (fla's
DeltaNet, the TTT layers' Mamba backbone; the gated-delta layer's is the fused op
``short_conv_silu``)."""

from __future__ import annotations

import torch


def causal_depthwise_conv(full: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y[:, c, t] = bias[c] + sum_j weight[c, 0, j] * full[:, c, t + j]``, the valid part of a
    depthwise ``conv1d``: ``full [B, C, T + W - 1]`` (the W - 1 carried inputs first), ``weight
    [C, 1, W]``, ``bias [C]`` or None -> ``[B, C, T]`` in ``full``'s dtype.

    The W taps are W shifted multiply-adds accumulated in float32 (or wider) and rounded once, as
    a convolution kernel does: PyTorch's CPU ``conv1d`` has no fast depthwise bfloat16/float16
    kernel (it loops over the C groups; what that cost: docs/performance.md), and for float32 at
    T = 1 this is cheaper than its dispatch."""
    acc = torch.promote_types(full.dtype, torch.float32)
    W = weight.shape[-1]
    T = full.shape[-1] - (W - 1)
    x = full.to(acc)  # one conversion, then W shifted views
    w = weight[:, 0, :].to(acc)  # [C, W]
    y = x[:, :, :T] * w[:, :1]
    for j in range(1, W):
        y = y.addcmul(x[:, :, j:j + T], w[:, j:j + 1])
    if bias is not None:
        y = y + bias.to(acc)[:, None]
    return y.to(full.dtype)
