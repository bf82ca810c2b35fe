"""Causal depthwise convolution over time, shared by the layers with short convolutions (fla's
DeltaNet, the TTT layers' Mamba backbone)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


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


class _ShortConv(torch.autograd.Function):
    """``short_conv``'s forward and its backward written out (autograd of the W shifted
    multiply-adds would allocate a zero-filled input-sized gradient per tap and add them)."""

    @staticmethod
    def forward(ctx, full, weight, bias, silu):  # type: ignore[override]
        acc = torch.promote_types(full.dtype, torch.float32)
        W = weight.shape[-1]
        T = full.shape[1] - (W - 1)
        x = full.to(acc)
        w = weight[:, 0, :].to(acc)  # [C, W]
        a = x[:, :T] * w[:, 0]
        for j in range(1, W):
            a.addcmul_(x[:, j:j + T], w[:, j])
        if bias is not None:
            a.add_(bias.to(acc))
        ctx.save_for_backward(x, w, a)
        ctx.silu, ctx.has_bias = silu, bias is not None
        ctx.dtypes = (full.dtype, weight.dtype)
        return (F.silu(a) if silu else a).to(full.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        x, w, a = ctx.saved_tensors
        W, T = w.shape[1], a.shape[1]
        da = dy.to(a.dtype)
        if ctx.silu:
            da = torch.ops.aten.silu_backward(da, a)
        dx = torch.zeros_like(x)
        dw = torch.empty_like(w)
        for j in range(W):
            dx[:, j:j + T].addcmul_(da, w[:, j])
            dw[:, j] = (da * x[:, j:j + T]).sum((0, 1))
        dbias = da.sum((0, 1)).to(ctx.dtypes[1]) if ctx.has_bias else None
        return dx.to(ctx.dtypes[0]), dw.unsqueeze(1).to(ctx.dtypes[1]), dbias, None


def short_conv(full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               silu: bool = False) -> torch.Tensor:
    """``causal_depthwise_conv`` over time-major inputs, SiLU after it with ``silu``:
    ``full [B, T + W - 1, C]`` (the W - 1 carried inputs first), ``weight [C, 1, W]``, ``bias
    [C]`` or None -> ``[B, T, C]`` in ``full``'s dtype. The same multiply-adds in the same order,
    so the same values as ``causal_depthwise_conv`` on the transposed input; time-major, each
    tap reads a contiguous block (no transposes around it), and its backward is written out: one
    input gradient, filled tap by tap in place (not differentiable twice)."""
    return _ShortConv.apply(full, weight, bias, silu)
