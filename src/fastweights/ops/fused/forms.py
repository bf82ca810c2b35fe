"""The PyTorch forms of the fused ops (ops/fused): the short convolution with SiLU and the L2
norm of its leading heads, the L2 norm alone, and the gated RMSNorm; the oracles of the
kernels in ``triton.py`` and what runs off CUDA and for float32/float64.

Dimension legend: B batch, T tokens, C channels, W taps, n = heads * head_dim the
L2-normalised leading channels, D the normalised size of the RMSNorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..._checks import state_dtype


def _l2_backward(dy: torch.Tensor, y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The gradient of y = x r, r = (sum x^2 + eps)^-1/2 over the last dim: r (dy - y sum(dy y))."""
    return (dy - y * (dy * y).sum(-1, keepdim=True)) * r


class _L2Normalize(torch.autograd.Function):
    """``l2_normalize`` with its backward written out: with r = (sum x^2 + eps)^-1/2 and
    y = x r, dx = r (dy - y sum(dy y)) (three passes over x where autograd's chain takes six)."""

    @staticmethod
    def forward(ctx, x, eps):  # type: ignore[override]
        r = torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)
        y = x * r
        ctx.save_for_backward(y, r)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        y, r = ctx.saved_tensors
        return _l2_backward(dy, y, r), None


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's and transformers' q/k norm, eps 1e-6)."""
    if torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling():
        return _L2Normalize.apply(x, eps)
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


class _ShortConvSilu(torch.autograd.Function):
    """``short_conv_silu_torch``'s forward and its backward written out (autograd of the W
    shifted multiply-adds would allocate a zero-filled input-sized gradient per tap and add
    them); the L2 norm of the leading ``n`` channels in place on the SiLU's output."""

    @staticmethod
    def forward(ctx, full, weight, bias, n, head_dim, eps):  # type: ignore[override]
        acc = torch.promote_types(full.dtype, torch.float32)
        W = weight.shape[-1]
        T = full.shape[1] - (W - 1)
        x = full.to(acc)
        w = weight.reshape(weight.shape[0], W).to(acc)  # [C, W]
        a = x[:, :T] * w[:, 0]
        for j in range(1, W):
            a.addcmul_(x[:, j:j + T], w[:, j])
        if bias is not None:
            a.add_(bias.to(acc))
        y = F.silu(a)
        r = None
        if n:
            heads = y[..., :n].unflatten(-1, (-1, head_dim))  # a view: normalised in place
            r = torch.rsqrt(heads.square().sum(-1, keepdim=True) + eps)
            heads.mul_(r)
        ctx.save_for_backward(x, w, a, y, r)
        ctx.n, ctx.head_dim, ctx.has_bias = n, head_dim, bias is not None
        ctx.dtypes = (full.dtype, weight.dtype, weight.shape)
        return y.to(full.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        x, w, a, y, r = ctx.saved_tensors
        W, T, n = w.shape[1], a.shape[1], ctx.n
        ds = dy.to(a.dtype)
        if n:  # the heads through the norm, then SiLU's backward into the two parts of da
            split = (-1, ctx.head_dim)
            dh = _l2_backward(ds[..., :n].unflatten(-1, split), y[..., :n].unflatten(-1, split),
                              r).flatten(-2)
            da = torch.empty_like(a)
            silu_bwd = torch.ops.aten.silu_backward.grad_input
            silu_bwd(dh, a[..., :n], grad_input=da[..., :n])
            silu_bwd(ds[..., n:], a[..., n:], grad_input=da[..., n:])
        else:
            da = torch.ops.aten.silu_backward(ds, a)
        dx = torch.zeros_like(x)
        dw = torch.empty_like(w)
        for j in range(W):
            dx[:, j:j + T].addcmul_(da, w[:, j])
            dw[:, j] = (da * x[:, j:j + T]).sum((0, 1))
        dbias = da.sum((0, 1)).to(ctx.dtypes[1]) if ctx.has_bias else None
        return (dx.to(ctx.dtypes[0]), dw.reshape(ctx.dtypes[2]).to(ctx.dtypes[1]), dbias,
                None, None, None)


def short_conv_silu_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          past: torch.Tensor | None, n: int, head_dim: int, eps: float
                          ) -> torch.Tensor:
    """``short_conv_silu``'s PyTorch form (its arguments checked): x [B, T, C], weight
    [C, 1, W] or [C, W], bias [C] or None, past [B, C, W - 1] or None -> y [B, T, C] in x's
    dtype, computed in float32 (float64 for float64 inputs). Time-major throughout: each tap
    reads a contiguous block of the W - 1 carried inputs and x, no transposed copies."""
    cdtype = state_dtype(x.dtype)
    B, _, C = x.shape
    Wm = weight.shape[-1] - 1
    past = (x.new_zeros(B, Wm, C, dtype=cdtype) if past is None
            else past.to(cdtype).transpose(1, 2))
    full = torch.cat([past, x.to(cdtype)], dim=1)  # [B, W - 1 + T, C]
    return _ShortConvSilu.apply(full, weight, bias, n, head_dim, eps).to(x.dtype)


def rms_norm_gated_torch(x: torch.Tensor, weight: torch.Tensor | None, gate: torch.Tensor | None,
                         eps: float, sigmoid: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``rms_norm_gated``'s PyTorch form: x / sqrt(mean(x^2) + eps) * weight * act(gate) over
    the last dim, act SiLU or (``sigmoid``) the sigmoid, computed in float32 (float64 for
    float64 inputs) and rounded to ``out_dtype`` once."""
    cdtype = state_dtype(x.dtype)
    xf = x if x.dtype == cdtype else x.to(cdtype)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(cdtype)
    if gate is not None:
        g = gate.to(cdtype)
        y = y * (torch.sigmoid(g) if sigmoid else F.silu(g))
    return y if y.dtype == out_dtype else y.to(out_dtype)
