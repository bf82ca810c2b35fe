"""Pieces shared by the TTT forms (SPEC.md 2.2-2.4): the inner LayerNorm and the gradient of the
inner loss through it, GELU (tanh) and its derivative, the mini-batch layout and the carried state.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, Dh = 4 Dk (MLP hidden),
b mini-batch size, N number of mini-batches in a call, p tokens of the first mini-batch that an
earlier call already consumed. Internal mini-batch layout: ``[B, H, N, b, D]``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

LN_EPS = 1e-6
_GELU_C = math.sqrt(2.0 / math.pi)

Weights = tuple[torch.Tensor | None, ...]  # (W, b) or (W1, b1, W2, b2), [B, H, ...]; None = no bias


class Carry(NamedTuple):
    """The inner learner's state between calls, in the form the kernels use.

    start: inner weights at the start of the current mini-batch (after the last full one).
    grads: sum over the current mini-batch so far of eta_j * grad_j (all taken at ``start``);
        None when ``pos`` is 0.
    pos: tokens of the current mini-batch already consumed, 0 <= pos < b.
    The weights after the last token are ``start - tau_pos * grads`` (SPEC 2.3).
    """

    start: Weights
    grads: Weights | None
    pos: int


def per_head(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshape a per-head tensor x [H, *s] to broadcast against like [B, H, ..., *s]."""
    extra = like.dim() - 2 - (x.dim() - 1)
    return x.reshape(x.shape[0], *([1] * extra), *x.shape[1:])


def layer_norm(
    z: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
) -> torch.Tensor:
    """Per-head LayerNorm over the last dim of z [B, H, ..., Dv]; weight, bias [H, Dv] (bias optional)."""
    y = F.layer_norm(z, z.shape[-1:], eps=LN_EPS)
    y = y * per_head(weight, y)
    return y if bias is None else y + per_head(bias, y)


def loss_grad(
    z: torch.Tensor, target: torch.Tensor, ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None,
) -> torch.Tensor:
    """dl/dZ of l = 1/2 ||[LN](Z) - target||^2 for every row of z [B, H, ..., Dv] (SPEC 2.2).

    With LayerNorm: x_hat = (Z - mu) / s, s = sqrt(var + eps), g = gamma * (LN(Z) - target),
    dl/dZ = (Dv g - sum g - x_hat sum(g x_hat)) / (Dv s). Without: Z - target.
    """
    if ln_weight is None:
        return z - target
    d = z.shape[-1]
    mu = z.mean(-1, keepdim=True)
    zc = z - mu
    # Biased variance and the forward eps, so this is exactly the derivative of layer_norm above.
    rstd = torch.rsqrt(zc.square().mean(-1, keepdim=True) + LN_EPS)
    x_hat = zc * rstd
    gamma = per_head(ln_weight, z)
    y = gamma * x_hat if ln_bias is None else gamma * x_hat + per_head(ln_bias, z)
    g = gamma * (y - target)
    return (d * g - g.sum(-1, keepdim=True) - x_hat * (g * x_hat).sum(-1, keepdim=True)) * (rstd / d)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (SPEC 2.2)."""
    return F.gelu(x, approximate="tanh")


def gelu_grad(x: torch.Tensor) -> torch.Tensor:
    """d gelu(x) / dx for the tanh approximation 0.5 x (1 + tanh(c (x + 0.044715 x^3)))."""
    t = torch.tanh(_GELU_C * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * x * x)


def to_minibatches(x: torch.Tensor, p: int, b: int) -> torch.Tensor:
    """[B, T, H, *rest] -> [B, H, N, b, *rest], with p zero rows in front (the part of the first
    mini-batch an earlier call consumed) and zero rows at the tail up to N*b."""
    B, T, H = x.shape[:3]
    N = -(-(p + T) // b)
    x = x.movedim(1, 2)  # [B, H, T, ...]
    pad = [0, 0] * (x.dim() - 3) + [p, N * b - p - T]
    return F.pad(x, pad).reshape(B, H, N, b, *x.shape[3:])


def from_minibatches(x: torch.Tensor, p: int, T: int) -> torch.Tensor:
    """[B, H, N, b, D] -> [B, T, H, D], dropping the padding rows."""
    B, H, N, b, D = x.shape
    return x.reshape(B, H, N * b, D)[:, :, p:p + T].transpose(1, 2)


def current_weights(carry: Carry, tau: torch.Tensor) -> Weights:
    """Weights after the last consumed token: start - tau_pos * grads (SPEC 2.3); tau [H, b]."""
    if carry.pos == 0:
        return carry.start
    t = tau[:, carry.pos - 1]  # [H]
    return tuple(
        None if w is None else w - per_head(t, w) * g for w, g in zip(carry.start, carry.grads)
    )
