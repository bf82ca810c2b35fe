"""Primal form of TTT-Linear and TTT-MLP (docs/maths.md 2.3), ``mode="primal"``: the explicit
weights W_i = W_0 - tau_i sum_{j<=i} eta_j grad_j(W_0) of every token, vectorised over the
mini-batch (it forms b per-token weight matrices per mini-batch, the cost the dual form avoids).

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, Dh = 4 Dk (MLP hidden),
b mini-batch size, N mini-batches in the call, p tokens of the first mini-batch consumed by an
earlier call. Inputs ``[B, T, H, D]`` and eta ``[B, T, H]`` in the compute dtype, tau ``[H, b]``,
inner weights ``[B, H, ...]`` in a ``Carry``.
"""

from __future__ import annotations

import torch

from .common import (
    Carry,
    Weights,
    from_minibatches,
    gelu,
    gelu_grad,
    layer_norm,
    loss_grad,
    to_minibatches,
)


def _per_token(
    start: Weights, grads: Weights, prior: Weights | None, tau: torch.Tensor,
) -> tuple[Weights, Weights]:
    """Per-token weights of one mini-batch and the running gradient sums behind them.

    start: items [B, H, *s]; grads: per-token eta_j grad_j, items [B, H, b, *s]; prior: sums of
    tokens an earlier call fed into this mini-batch. Returns (W_i items [B, H, b, *s], running
    sums items [B, H, b, *s]).
    """
    weights, sums = [], []
    for w, g, g0 in zip(start, grads, prior if prior is not None else (None,) * len(start)):
        if w is None:
            weights.append(None)
            sums.append(None)
            continue
        run = g.cumsum(dim=2)
        if g0 is not None:
            run = run + g0.unsqueeze(2)
        t = tau.reshape(tau.shape[0], tau.shape[1], *([1] * (w.dim() - 2)))  # [H, b, 1, ...]
        weights.append(w.unsqueeze(2) - t * run)
        sums.append(run)
    return tuple(weights), tuple(sums)


def _outer(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-token gradients x_j^T g_j: x [B, H, b, Din], g [B, H, b, Dout] -> [B, H, b, Din, Dout]."""
    return x.unsqueeze(-1) * g.unsqueeze(-2)


def _apply(x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Row i through its own weights: x [B, H, b, Din], W [B, H, b, Din, Dout], bias [B, H, b, Dout]."""
    z = (x.unsqueeze(-2) @ W).squeeze(-2)
    return z if bias is None else z + bias


def _last(items: Weights) -> Weights:
    """The last row of per-token items [B, H, b, *s] -> [B, H, *s] (padding rows add nothing)."""
    return tuple(None if x is None else x[:, :, -1] for x in items)


def ttt_linear_primal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor,
) -> tuple[torch.Tensor, Carry]:
    """TTT-Linear with explicit per-token weights. Returns (o [B, T, H, Dv], carry)."""
    T, b, p = q.shape[1], tau.shape[-1], carry.pos
    Q, K, V = (to_minibatches(x, p, b) for x in (q, k, v))  # [B, H, N, b, D]
    eta_mb = to_minibatches(eta.unsqueeze(-1), p, b)  # [B, H, N, b, 1]; padding rows get eta 0
    target = V - K if residual else V
    N, tail = Q.shape[2], (p + T) % b
    start, prior, grads, outs = carry.start, carry.grads, None, []
    # unbind (not indexing) so that autograd gathers the per-step gradients in one stack
    for n, (Qn, Kn, tgt, e) in enumerate(zip(*(x.unbind(2) for x in (Q, K, target, eta_mb)))):
        W, bias = start
        Zk = Kn @ W if bias is None else Kn @ W + bias.unsqueeze(-2)
        eG = e * loss_grad(Zk, tgt, ln_weight, ln_bias)  # [B, H, b, Dv]
        (Wi, bi), sums = _per_token(start, (_outer(Kn, eG), eG), prior, tau)
        outs.append(_apply(Qn, Wi, bi))
        if n == N - 1 and tail:
            grads = _last(sums)  # the call ends inside this mini-batch: keep its start weights
        else:
            start = _last((Wi, bi))
        prior = None
    Z = torch.stack(outs, dim=2)  # [B, H, N, b, Dv]
    out = Z if ln_weight is None else layer_norm(Z, ln_weight, ln_bias)
    if residual:
        out = out + Q
    return from_minibatches(out, p, T), Carry(start, grads, tail)


def ttt_mlp_primal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor,
) -> tuple[torch.Tensor, Carry]:
    """TTT-MLP with explicit per-token weights. Returns (o [B, T, H, Dv], carry)."""
    T, b, p = q.shape[1], tau.shape[-1], carry.pos
    Q, K, V = (to_minibatches(x, p, b) for x in (q, k, v))
    eta_mb = to_minibatches(eta.unsqueeze(-1), p, b)  # [B, H, N, b, 1]
    target = V - K if residual else V
    N, tail = Q.shape[2], (p + T) % b
    start, prior, grads, outs = carry.start, carry.grads, None, []
    for n, (Qn, Kn, tgt, e) in enumerate(zip(*(x.unbind(2) for x in (Q, K, target, eta_mb)))):
        W1, b1, W2, b2 = start
        Z1 = Kn @ W1 if b1 is None else Kn @ W1 + b1.unsqueeze(-2)  # [B, H, b, Dh]
        X2 = gelu(Z1)
        Z2 = X2 @ W2 if b2 is None else X2 @ W2 + b2.unsqueeze(-2)
        G2 = loss_grad(Z2, tgt, ln_weight, ln_bias)  # [B, H, b, Dv]
        G1 = (G2 @ W2.transpose(-1, -2)) * gelu_grad(Z1)  # [B, H, b, Dh]
        eG1, eG2 = e * G1, e * G2
        (W1i, b1i, W2i, b2i), sums = _per_token(
            start, (_outer(Kn, eG1), eG1, _outer(X2, eG2), eG2), prior, tau)
        outs.append(_apply(gelu(_apply(Qn, W1i, b1i)), W2i, b2i))
        if n == N - 1 and tail:
            grads = _last(sums)
        else:
            start = _last((W1i, b1i, W2i, b2i))
        prior = None
    Z = torch.stack(outs, dim=2)
    out = Z if ln_weight is None else layer_norm(Z, ln_weight, ln_bias)
    if residual:
        out = out + Q
    return from_minibatches(out, p, T), Carry(start, grads, tail)
