"""Dual form of TTT-Linear and TTT-MLP (SPEC.md 2.4), the default ``mode="dual"``: this family's
fast parallel tier (what ``chunk.py`` is to the other families).

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, Dh = 4 Dk (MLP hidden),
b mini-batch size, N mini-batches in the call, p tokens of the first mini-batch consumed by an
earlier call. Inputs ``[B, T, H, D]`` and eta ``[B, T, H]`` in the compute dtype, tau ``[H, b]``,
inner weights ``[B, H, ...]`` in a ``Carry``.

Per mini-batch with start weights (W_0, b_0), E_ij = tau_i eta_j (j <= i) and G the loss gradients
at the start weights:  Zbar = Q W_0 - (E * Q K^T) G + b_0 - E G, the next start weights
W_0 - K^T diag(E_b,:) G. Only the hand-off of start weights is sequential; per mini-batch the loop
does one matmul of keys and queries together, the LayerNorm gradient and one update matmul, and
everything that does not depend on the start weights (E, the masked Q K^T, the output LayerNorm)
is batched over all mini-batches. No per-token weight matrix is ever formed.
"""

from __future__ import annotations

import torch

from .common import (
    Carry, Weights, from_minibatches, gelu, gelu_grad, layer_norm, loss_grad, per_head,
    to_minibatches,
)


def _layout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, p: int,
    residual: bool, tau: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Mini-batch views Q, K [B, H, N, b, Dk], target [B, H, N, b, Dv], eta [B, H, N, b] and the
    causal step-size matrix E [B, H, N, b, b], E_ij = tau_i eta_j for j <= i, else 0."""
    b = tau.shape[-1]
    Q, K, V = (to_minibatches(x, p, b) for x in (q, k, v))
    # Padding rows get eta = 0, so they never contribute to any gradient sum.
    eta_mb = to_minibatches(eta.unsqueeze(-1), p, b).squeeze(-1)
    target = V - K if residual else V  # SPEC 2.2: the residual moves into the target
    E = (per_head(tau.unsqueeze(-1), eta_mb.unsqueeze(-1)) * eta_mb.unsqueeze(-2)).tril()
    return Q, K, target, eta_mb, E


def _add(a: Weights, b: Weights | None) -> Weights:
    """Item-wise a + b over weight tuples (None items stay None)."""
    if b is None:
        return a
    return tuple(None if x is None else x + y for x, y in zip(a, b))


def _step(start: Weights, sums: Weights, tau_b: torch.Tensor) -> Weights:
    """End of a full mini-batch: W_b = W_0 - tau_b * sum_j eta_j grad_j (SPEC 2.3); tau_b [H]."""
    return tuple(None if w is None else w - per_head(tau_b, w) * s for w, s in zip(start, sums))


def _eta_sum(eta_n: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """sum_j eta_j G_j over the mini-batch: eta_n [B, H, b], G [B, H, b, D] -> [B, H, D]."""
    return (eta_n.unsqueeze(-2) @ G).squeeze(-2)


def ttt_linear_dual(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor,
) -> tuple[torch.Tensor, Carry]:
    """TTT-Linear, f_res(z) = z W + b, in the dual form. Returns (o [B, T, H, Dv], carry)."""
    T, b, p = q.shape[1], tau.shape[-1], carry.pos
    Q, K, target, eta_mb, E = _layout(q, k, v, eta, p, residual, tau)
    N = Q.shape[2]
    W, bias = carry.start
    QK = Q @ K.transpose(-1, -2)  # [B, H, N, b, b]
    # The bias's own updates enter the output like a key whose dot product with every query is 1.
    M = E * (QK + 1.0 if bias is not None else QK)
    KQ = torch.cat([K, Q], dim=-2)  # [B, H, N, 2b, Dk]: one matmul per step for both
    KT_eta = (K * eta_mb.unsqueeze(-1)).transpose(-1, -2)  # [B, H, N, Dk, b]
    tau_rows = tau.unsqueeze(-1)  # [H, b, 1] against [B, H, b, D]
    tail = (p + T) % b  # tokens in a last, partly filled mini-batch (0: it is full)
    zq, Gs, b_start, grads = [], [], [], None
    # unbind (not indexing) so that autograd gathers the per-step gradients in one stack
    steps = zip(KQ.unbind(2), target.unbind(2), KT_eta.unbind(2), eta_mb.unbind(2))
    for n, (kq, tgt, kt_eta, eta_n) in enumerate(steps):
        Z = kq @ W  # [B, H, 2b, Dv]
        Zk, Zq = Z[..., :b, :], Z[..., b:, :]
        if bias is not None:
            Zk = Zk + bias.unsqueeze(-2)
            b_start.append(bias)
        G = loss_grad(Zk, tgt, ln_weight, ln_bias)  # [B, H, b, Dv]
        sums = (kt_eta @ G, None if bias is None else _eta_sum(eta_n, G))
        if n == 0 and carry.grads is not None:
            # Tokens of this mini-batch seen by an earlier call: their gradient sums reach every
            # later row i through W_i = W_0 - tau_i (sums_before + ...).
            gW, gb = carry.grads
            prior = Q[:, :, 0] @ gW
            Zq = Zq - tau_rows * (prior if gb is None else prior + gb.unsqueeze(-2))
            sums = _add(sums, carry.grads)
        zq.append(Zq)
        Gs.append(G)
        if n == N - 1 and tail:
            grads = sums
        else:
            W, bias = _step((W, bias), sums, tau[:, -1])
    G = torch.stack(Gs, dim=2)  # [B, H, N, b, Dv]
    Zbar = torch.stack(zq, dim=2) - M @ G
    if b_start:
        Zbar = Zbar + torch.stack(b_start, dim=2).unsqueeze(-2)
    out = Zbar if ln_weight is None else layer_norm(Zbar, ln_weight, ln_bias)
    if residual:
        out = out + Q
    return from_minibatches(out, p, T), Carry((W, bias), grads, tail)


def ttt_mlp_dual(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor,
) -> tuple[torch.Tensor, Carry]:
    """TTT-MLP, f_res(z) = gelu(z W1 + b1) W2 + b2, in the dual form (the second layer's
    A2 = tril(Xbar2 X2^T) pairs the queries' hidden rows with the keys' hidden rows at W1_0).
    Returns (o [B, T, H, Dv], carry)."""
    T, b, p = q.shape[1], tau.shape[-1], carry.pos
    Q, K, target, eta_mb, E = _layout(q, k, v, eta, p, residual, tau)
    N = Q.shape[2]
    W1, b1, W2, b2 = carry.start
    QK = Q @ K.transpose(-1, -2)
    M1 = E * (QK + 1.0 if b1 is not None else QK)  # [B, H, N, b, b]
    KQ = torch.cat([K, Q], dim=-2)
    KT_eta = (K * eta_mb.unsqueeze(-1)).transpose(-1, -2)  # [B, H, N, Dk, b]
    tau_rows = tau.unsqueeze(-1)
    tail = (p + T) % b
    X2s, Xbar2s, G2s, zq2, b2_start, grads = [], [], [], [], [], None
    steps = zip(KQ.unbind(2), target.unbind(2), KT_eta.unbind(2), eta_mb.unbind(2), M1.unbind(2))
    for n, (kq, tgt, kt_eta, eta_n, m1) in enumerate(steps):
        Z = kq @ W1  # [B, H, 2b, Dh]
        if b1 is not None:
            Z = Z + b1.unsqueeze(-2)
        Z1, Zq1 = Z[..., :b, :], Z[..., b:, :]
        X2 = gelu(Z1)  # [B, H, b, Dh]
        Z2 = X2 @ W2 if b2 is None else X2 @ W2 + b2.unsqueeze(-2)
        G2 = loss_grad(Z2, tgt, ln_weight, ln_bias)  # [B, H, b, Dv]
        G1 = (G2 @ W2.transpose(-1, -2)) * gelu_grad(Z1)  # [B, H, b, Dh]
        Zbar1 = Zq1 - m1 @ G1
        if n == 0 and carry.grads is not None:
            gW1, gb1 = carry.grads[:2]
            prior = Q[:, :, 0] @ gW1
            Zbar1 = Zbar1 - tau_rows * (prior if gb1 is None else prior + gb1.unsqueeze(-2))
        Xbar2 = gelu(Zbar1)
        Zq2 = Xbar2 @ W2  # [B, H, b, Dv]
        if n == 0 and carry.grads is not None:
            gW2, gb2 = carry.grads[2:]
            prior = Xbar2 @ gW2
            Zq2 = Zq2 - tau_rows * (prior if gb2 is None else prior + gb2.unsqueeze(-2))
        sums = (
            kt_eta @ G1, None if b1 is None else _eta_sum(eta_n, G1),
            (X2 * eta_n.unsqueeze(-1)).transpose(-1, -2) @ G2,
            None if b2 is None else _eta_sum(eta_n, G2),
        )
        if n == 0:
            sums = _add(sums, carry.grads)
        X2s.append(X2)
        Xbar2s.append(Xbar2)
        G2s.append(G2)
        zq2.append(Zq2)
        if b2 is not None:
            b2_start.append(b2)
        if n == N - 1 and tail:
            grads = sums
        else:
            W1, b1, W2, b2 = _step((W1, b1, W2, b2), sums, tau[:, -1])
    X2, Xbar2, G2 = (torch.stack(x, dim=2) for x in (X2s, Xbar2s, G2s))  # [B, H, N, b, *]
    A2 = Xbar2 @ X2.transpose(-1, -2)
    M2 = E * (A2 + 1.0 if b2_start else A2)
    Zbar2 = torch.stack(zq2, dim=2) - M2 @ G2
    if b2_start:
        Zbar2 = Zbar2 + torch.stack(b2_start, dim=2).unsqueeze(-2)
    out = Zbar2 if ln_weight is None else layer_norm(Zbar2, ln_weight, ln_bias)
    if residual:
        out = out + Q
    return from_minibatches(out, p, T), Carry((W1, b1, W2, b2), grads, tail)
