"""One-token form of TTT-Linear and TTT-MLP (SPEC.md 2.3, "decoding one token at a time"): what
``mode="dual"`` runs for T = 1, the decoding step.

The dual form would place the token in a zero-padded mini-batch of b rows and build its b x b
matrices; here the token is a row: its gradient at the mini-batch's start weights W_0 is added to
the running sums S = sum_j eta_j grad_j, and it reads with W_i = W_0 - tau_i S, i its position in
the mini-batch. Same arithmetic as the dual and primal forms, so it agrees with them to rounding.

Dimension legend: B batch, H heads, Dk key/query dim, Dv value dim, Dh = 4 Dk (MLP hidden).
Inputs ``[B, 1, H, D]`` and eta ``[B, 1, H]`` in the compute dtype, tau ``[H, b]``, inner
weights ``[B, H, ...]`` in a ``Carry``.
"""

from __future__ import annotations

import torch

from .common import Carry, Weights, gelu, gelu_grad, layer_norm, loss_grad


def _apply(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [B, H, Din] through W [B, H, Din, Dout] (+ b [B, H, Dout]) -> [B, H, Dout]."""
    z = (x.unsqueeze(-2) @ W).squeeze(-2)
    return z if b is None else z + b


def _learn(
    W: torch.Tensor, b: torch.Tensor | None, prior: tuple[torch.Tensor, torch.Tensor | None] | None,
    x: torch.Tensor, eg: torch.Tensor, t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """One layer's running sums after this token and the weights it reads with:
    S_W = prior_W + x^T eg, S_b = prior_b + eg, W_i = W - t S_W, b_i = b - t S_b.
    x [B, H, Din], eg = eta * grad [B, H, Dout], t = tau_i [1, H]. Returns (S_W, S_b, W_i, b_i)."""
    # Two passes over each [Din, Dout] matrix (fused multiply-adds), the step's main cost.
    xT, g = x.unsqueeze(-1), eg.unsqueeze(-2)
    sW = xT * g if prior is None else torch.addcmul(prior[0], xT, g)  # [B, H, Din, Dout]
    sb = None if b is None else (eg if prior is None else eg + prior[1])
    Wi = torch.addcmul(W, t[..., None, None], sW, value=-1.0)
    bi = None if b is None else torch.addcmul(b, t[..., None], sb, value=-1.0)
    return sW, sb, Wi, bi


def _carry(
    carry: Carry, sums: tuple[torch.Tensor | None, ...], current: tuple[torch.Tensor | None, ...],
    b: int,
) -> tuple[Carry, tuple[torch.Tensor | None, ...]]:
    """The carry after the token (a completed mini-batch commits the current weights) and the
    current weights, which the public state leads with (``Carry.final_state``)."""
    pos = carry.pos + 1
    if pos == b:
        return Carry(current, None, 0), current
    return Carry(carry.start, sums, pos), current


def _finish(
    z: torch.Tensor, q: torch.Tensor, ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None, residual: bool,
) -> torch.Tensor:
    """Output row z [B, H, Dv] -> o [B, 1, H, Dv]: LayerNorm (when given) and residual."""
    out = z if ln_weight is None else layer_norm(z, ln_weight, ln_bias)
    if residual:
        out = out + q
    return out.unsqueeze(1)


def ttt_linear_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor,
) -> tuple[torch.Tensor, tuple[Carry, Weights]]:
    """TTT-Linear for one token. Returns (o [B, 1, H, Dv], (carry, current weights))."""
    q, k, v, e = q[:, 0], k[:, 0], v[:, 0], eta[:, 0, :, None]  # [B, H, D], e [B, H, 1]
    W, bias = carry.start
    t = tau[:, carry.pos].unsqueeze(0)  # [1, H]
    G = loss_grad(_apply(k, W, bias), v - k if residual else v, ln_weight, ln_bias)
    prior = None if carry.grads is None else carry.grads
    sW, sb, Wi, bi = _learn(W, bias, prior, k, e * G, t)
    z = _apply(q, Wi, bi)
    return (_finish(z, q, ln_weight, ln_bias, residual),
            _carry(carry, (sW, sb), (Wi, bi), tau.shape[-1]))


def ttt_mlp_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor,
) -> tuple[torch.Tensor, tuple[Carry, Weights]]:
    """TTT-MLP for one token. Returns (o [B, 1, H, Dv], (carry, current weights))."""
    q, k, v, e = q[:, 0], k[:, 0], v[:, 0], eta[:, 0, :, None]
    W1, b1, W2, b2 = carry.start
    t = tau[:, carry.pos].unsqueeze(0)
    Z1 = _apply(k, W1, b1)  # [B, H, Dh]
    X2 = gelu(Z1)
    G2 = loss_grad(_apply(X2, W2, b2), v - k if residual else v, ln_weight, ln_bias)  # [B, H, Dv]
    G1 = (G2.unsqueeze(-2) @ W2.transpose(-1, -2)).squeeze(-2) * gelu_grad(Z1)  # [B, H, Dh]
    p1, p2 = (None, None) if carry.grads is None else (carry.grads[:2], carry.grads[2:])
    sW1, sb1, W1i, b1i = _learn(W1, b1, p1, k, e * G1, t)
    sW2, sb2, W2i, b2i = _learn(W2, b2, p2, X2, e * G2, t)
    z = _apply(gelu(_apply(q, W1i, b1i)), W2i, b2i)
    return (_finish(z, q, ln_weight, ln_bias, residual),
            _carry(carry, (sW1, sb1, sW2, sb2), (W1i, b1i, W2i, b2i), tau.shape[-1]))
