"""Oracle for TTT-Linear and TTT-MLP (docs/maths.md 2.2-2.3), ``mode="naive"``: a literal token
loop.

For each token: the gradient of l_t = 1/2 ||[LN](f_res(k_t; W_0)) - target_t||^2 at the
mini-batch's start weights W_0 is taken by autograd (so the oracle shares nothing with the
hand-written LayerNorm gradient of the fast forms), added to the running sum
S = sum_{j<=i} eta_j grad_j, and the output is read with W_i = W_0 - tau_i S; after b tokens
W_b becomes the next start. Slow; for tests.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, b mini-batch size.
Inputs ``[B, T, H, D]`` and eta ``[B, T, H]`` in the compute dtype, tau ``[H, b]``, inner weights
``[B, H, ...]`` in a ``Carry``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .common import LN_EPS, Carry, Weights

FRes = Callable[[torch.Tensor, Weights], torch.Tensor]


def linear_f_res(x: torch.Tensor, weights: Weights) -> torch.Tensor:
    """z W + b for one token x [B, H, Dk] -> [B, H, Dv]."""
    W, b = weights
    z = torch.einsum("bhd,bhde->bhe", x, W)
    return z if b is None else z + b


def mlp_f_res(x: torch.Tensor, weights: Weights) -> torch.Tensor:
    """gelu_tanh(z W1 + b1) W2 + b2 for one token x [B, H, Dk] -> [B, H, Dv]."""
    W1, b1, W2, b2 = weights
    h = torch.einsum("bhd,bhde->bhe", x, W1)
    h = F.gelu(h if b1 is None else h + b1, approximate="tanh")
    z = torch.einsum("bhd,bhde->bhe", h, W2)
    return z if b2 is None else z + b2


def _inner(
    f_res: FRes, x: torch.Tensor, weights: Weights, ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None,
) -> torch.Tensor:
    """[LN](f_res(x)) for one token x [B, H, Dk]; LN over Dv with per-head gamma, beta [H, Dv]."""
    z = f_res(x, weights)
    if ln_weight is None:
        return z
    mu = z.mean(-1, keepdim=True)
    var = (z - mu).square().mean(-1, keepdim=True)
    z = (z - mu) / torch.sqrt(var + LN_EPS) * ln_weight
    return z if ln_bias is None else z + ln_bias


def _grads(loss_of: Callable[[Weights], torch.Tensor], weights: Weights, create_graph: bool) -> Weights:
    """Autograd gradient of a scalar inner loss w.r.t. each weight (None items stay None).
    Without ``create_graph`` every weight is detached first: a weight that requires grad but was
    made in no-grad mode (an initial state broadcast over the batch under torch.no_grad) is a
    view autograd does not differentiate through."""
    with torch.enable_grad():
        leaves = tuple(
            None if w is None else (
                w if create_graph and w.requires_grad else w.detach().requires_grad_())
            for w in weights
        )
        present = [w for w in leaves if w is not None]
        got = iter(torch.autograd.grad(loss_of(leaves), present, create_graph=create_graph))
    return tuple(None if w is None else next(got) for w in leaves)


def _scaled(weights: Weights, coeff: torch.Tensor, sums: Weights) -> Weights:
    """weights + coeff * sums item-wise; coeff is [B, H] or [H], broadcast over each item's dims."""
    out = []
    for w, s in zip(weights, sums):
        c = None if w is None else coeff.reshape(*coeff.shape, *([1] * (w.dim() - 2)))
        out.append(None if w is None else w + c * s)
    return tuple(out)


def ttt_naive(
    f_res: FRes, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor,
    carry: Carry, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor,
) -> tuple[torch.Tensor, Carry]:
    """Token-by-token TTT with inner model ``f_res``. Returns (o [B, T, H, Dv], carry)."""
    b = tau.shape[-1]
    inputs = (q, k, v, eta, tau, ln_weight, ln_bias, *carry.start, *(carry.grads or ()))
    differentiable = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in inputs)
    zeros = tuple(None if w is None else torch.zeros_like(w) for w in carry.start)
    start, pos = carry.start, carry.pos
    sums = carry.grads if carry.grads is not None else zeros
    outs = []
    for t in range(q.shape[1]):
        qt, kt = q[:, t], k[:, t]  # [B, H, Dk]
        target = v[:, t] - kt if residual else v[:, t]  # docs/maths.md 2.2: residual in the target

        def loss(w: Weights, kt=kt, target=target) -> torch.Tensor:
            return 0.5 * (_inner(f_res, kt, w, ln_weight, ln_bias) - target).square().sum()

        sums = _scaled(sums, eta[:, t], _grads(loss, start, differentiable))
        pos += 1
        current = _scaled(start, -tau[:, pos - 1], sums)
        o = _inner(f_res, qt, current, ln_weight, ln_bias)
        outs.append(qt + o if residual else o)
        if pos == b:
            start, sums, pos = current, zeros, 0
    return torch.stack(outs, dim=1), Carry(start, sums if pos else None, pos)
