"""Dual form of TTT-Linear and TTT-MLP (docs/maths.md 2.4), the default ``mode="dual"``: this
family's chunk tier, the fast parallel form, by mini-batch (the "chunks" of TTT).

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, Dh = 4 Dk (MLP hidden),
b mini-batch size, N mini-batches in the call, p tokens of the first mini-batch consumed by an
earlier call. Inputs ``[B, T, H, D]`` and eta ``[B, T, H]`` in the compute dtype, tau ``[H, b]``,
inner weights ``[B, H, ...]`` in a ``Carry``.

Per mini-batch with start weights (W_0, b_0), E_ij = tau_i eta_j (j <= i) and G the loss gradients
at the start weights:  Zbar = Q W_0 - (E * Q K^T) G + b_0 - E G, the next start weights
W_0 - K^T diag(E_b,:) G. Only the hand-off of start weights is sequential; per mini-batch the loop
does one matmul of keys and queries together, the LayerNorm gradient and one update matmul, and
everything that does not depend on the start weights (E, the masked Q K^T, the output LayerNorm)
is batched over all mini-batches. No per-token weight matrix is ever formed. A bias is folded
into its matrix as an extra row, with a column of ones on the inputs (``_join``/``_ones``), so it
needs no separate code: E * (Q K^T + 1) then covers both terms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from .common import (
    Carry,
    from_minibatches,
    fused_ln_loss_grad,
    gelu,
    gelu_grad,
    kq_steps,
    layer_norm,
    loss_grad,
    per_head,
    steps_to_output,
    to_minibatches,
    to_steps,
)
from .mlp_scan import mlp_scan


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
    target = V - K if residual else V  # docs/maths.md 2.2: the residual moves into the target
    E = (per_head(tau.unsqueeze(-1), eta_mb.unsqueeze(-1)) * eta_mb.unsqueeze(-2)).tril()
    return Q, K, target, eta_mb, E


def _join(W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Fold a bias into its matrix as an extra input row: [B, H, Din, Dout] -> [B, H, Din+1, Dout].
    With a column of ones appended to the inputs (``_ones``), x W + b = [x, 1] W_aug, and the
    bias's gradient and updates come out of the same matmuls as the matrix's."""
    return W if b is None else torch.cat([W, b.unsqueeze(-2)], dim=-2)


def _split(W: torch.Tensor, has_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Undo ``_join``."""
    return (W[..., :-1, :], W[..., -1, :]) if has_bias else (W, None)


def _ones(x: torch.Tensor, has_bias: bool) -> torch.Tensor:
    """Append the bias's column of ones to x [..., D] -> [..., D+1] (no-op without a bias)."""
    return F.pad(x, (0, 1), value=1.0) if has_bias else x


def _scan(run: Callable[..., tuple[Any, ...]], N: int, group: int | None,
          *weights: torch.Tensor) -> tuple[Any, ...]:
    """Run the sequential mini-batch scan ``run(n0, n1, *weights)`` over all N mini-batches.

    With ``group`` g (and gradients being recorded) the scan goes g mini-batches at a time, each
    group under ``torch.utils.checkpoint``: the backward pass keeps only the weights entering
    every group and the per-token rows the batched read-out needs, and runs the group's forward
    again (docs/maths.md 2.6: the paper checkpoints groups of 4 mini-batches). Without it the
    per-step weights of every mini-batch stay alive for the backward pass. Same results either way.
    Returns the final weights, the per-step outputs concatenated over groups and the last
    group's trailing gradient sums (or None)."""
    if not group or group >= N or not torch.is_grad_enabled():
        return run(0, N, *weights)
    n_w = len(weights)
    pieces, tail = [], None
    for n0 in range(0, N, group):
        res = torch.utils.checkpoint.checkpoint(run, n0, min(n0 + group, N), *weights,
                                                use_reentrant=False, preserve_rng_state=False)
        weights, outs, tail = res[:n_w], res[n_w:-1], res[-1]
        pieces.append(outs)
    return (*weights, *(torch.cat(x, dim=2) for x in zip(*pieces)), tail)


def _records_grad(*xs: torch.Tensor | None) -> bool:
    """Whether autograd records a graph through any of xs."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def ttt_linear_dual(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor, checkpoint_group: int | None = None,
) -> tuple[torch.Tensor, Carry]:
    """TTT-Linear, f_res(z) = z W + b, in the dual form. Returns (o [B, T, H, Dv], carry).
    ``checkpoint_group``: see ``_scan``. Without a gradient to record (and outside traced
    programs) the step-major scan ``_ttt_linear_dual_inference`` runs instead: same results."""
    if not torch.compiler.is_compiling() and not _records_grad(
            q, k, v, eta, ln_weight, ln_bias, tau, *carry.start, *(carry.grads or ())):
        return _ttt_linear_dual_inference(q, k, v, eta, carry, ln_weight, ln_bias, residual, tau)
    T, b, p = q.shape[1], tau.shape[-1], carry.pos
    Q, K, target, eta_mb, E = _layout(q, k, v, eta, p, residual, tau)
    has_bias = carry.start[1] is not None
    W = _join(*carry.start)  # [B, H, Dk(+1), Dv]
    prior = None if carry.grads is None else _join(*carry.grads)
    Qa, Ka = _ones(Q, has_bias), _ones(K, has_bias)  # [B, H, N, b, Dk(+1)]
    M = E * (Qa @ Ka.transpose(-1, -2))  # [B, H, N, b, b]
    KQ = torch.cat([Ka, Qa], dim=-2)  # one matmul per step for keys and queries
    KT_eta = (Ka * eta_mb.unsqueeze(-1)).transpose(-1, -2)  # [B, H, N, Dk(+1), b]
    tau_rows, tau_b = tau.unsqueeze(-1), per_head(tau[:, -1], W)  # [H, b, 1], [H, 1, 1]
    tail = (p + T) % b  # tokens in a last, partly filled mini-batch (0: it is full)
    N = Q.shape[2]
    # unbind (not indexing) so that autograd gathers the per-step gradients in one stack
    steps = list(zip(KQ.unbind(2), target.unbind(2), KT_eta.unbind(2)))

    def run(n0: int, n1: int, W: torch.Tensor) -> tuple[Any, ...]:
        """Mini-batches n0..n1-1 from start weights W: (W after them, Zq [B, H, n, b, Dv],
        G [B, H, n, b, Dv], gradient sums of a trailing partial mini-batch or None)."""
        zq, Gs, grads = [], [], None
        for n in range(n0, n1):
            kq, tgt, kt_eta = steps[n]
            Z = kq @ W  # [B, H, 2b, Dv]: keys' and queries' outputs at the start weights
            G = loss_grad(Z[..., :b, :], tgt, ln_weight, ln_bias)  # [B, H, b, Dv]
            Zq, sums = Z[..., b:, :], kt_eta @ G
            if n == 0 and prior is not None:
                # Tokens of this mini-batch seen by an earlier call: their gradient sums reach
                # every later row i through W_i = W_0 - tau_i (sums_before + ...).
                Zq = Zq - tau_rows * (Qa[:, :, 0] @ prior)
                sums = sums + prior
            zq.append(Zq)
            Gs.append(G)
            if n == N - 1 and tail:
                grads = sums
            else:
                W = W - tau_b * sums  # docs/maths.md 2.3: W_b = W_0 - tau_b sum_j eta_j grad_j
        return W, torch.stack(zq, dim=2), torch.stack(Gs, dim=2), grads

    W, zq, Gs, grads = _scan(run, N, checkpoint_group, W)
    Zbar = zq - M @ Gs  # [B, H, N, b, Dv]
    out = Zbar if ln_weight is None else layer_norm(Zbar, ln_weight, ln_bias)
    if residual:
        out = out + Q
    return from_minibatches(out, p, T), Carry(
        _split(W, has_bias), None if grads is None else _split(grads, has_bias), tail)


def _ttt_linear_dual_inference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor,
) -> tuple[torch.Tensor, Carry]:
    """``ttt_linear_dual`` without autograd, in the step-major layout of TTT-MLP's scan
    ([N, B*H, b, D], common.to_steps): per mini-batch four calls on contiguous blocks (keys' and
    queries' outputs at the start weights in one product, the loss gradient, the read-out
    Zbar = Zq - M G written straight into the output buffer, the weights' rank-b update in
    place), and nothing stacked or concatenated afterwards. Few and reused buffers matter on
    CPU: each fresh large buffer costs first-touch page faults, which do not get faster with
    more threads."""
    (B, T, H, Dk), Dv, b, p = q.shape, v.shape[-1], tau.shape[-1], carry.pos
    has_bias = carry.start[1] is not None
    W = _join(*carry.start).flatten(0, 1).clone()  # [BH, Dk1, Dv], updated in place
    P = None if carry.grads is None else _join(*carry.grads).flatten(0, 1)
    KQ = kq_steps(k, q, p, b, has_bias)  # [N, BH, 2b, Dk1]
    Ka, Qa = KQ[:, :, :b], KQ[:, :, b:]
    tgt = to_steps(v, p, b)  # [N, BH, b, Dv] (a view of v itself when B = H = 1)
    if residual:  # docs/maths.md 2.2: the residual moves into the target
        tgt = tgt - Ka[..., :Dk]
    eta_s = to_steps(eta.unsqueeze(-1), p, b)  # [N, BH, b, 1]; padding rows 0
    tau_r = tau.repeat(B, 1).unsqueeze(-1)  # [BH, b, 1]
    tau_b = tau_r[:, -1:]  # [BH, 1, 1]
    # M = E * (Qa Ka^T), E_ij = tau_i eta_j (j <= i): the b x b read-out term of every step
    M = (Qa @ Ka.transpose(-1, -2)).mul_(tau_r * eta_s.transpose(-1, -2)).tril_()
    ka_up = (Ka * (eta_s * tau_b)).transpose(-1, -2)  # [N, BH, Dk1, b]: tau_b eta_j k_j^T
    gamma = beta = None
    if ln_weight is not None:
        gamma = ln_weight.repeat(B, 1).unsqueeze(-2)  # [BH, 1, Dv]
        beta = None if ln_bias is None else ln_bias.repeat(B, 1).unsqueeze(-2)
    N = KQ.shape[0]
    tail = (p + T) % b
    Zbar = tgt.new_empty(N, B * H, b, Dv)
    grads = None
    for n, (kq, tg, m, ku, zb) in enumerate(zip(KQ, tgt, M, ka_up, Zbar)):
        Z = torch.matmul(kq, W)  # [BH, 2b, Dv]: keys' and queries' outputs at the start weights
        Zk = Z[:, :b]
        G = Zk - tg if gamma is None else fused_ln_loss_grad(Zk, tg, gamma, beta)
        o = torch.baddbmm(Z[:, b:], m, G, alpha=-1, out=zb)
        if n == 0 and P is not None:
            # Tokens of this mini-batch seen by an earlier call: their gradient sums reach
            # every later row i through W_i = W_0 - tau_i (sums_before + ...).
            o.sub_(tau_r * (Qa[0] @ P))
        if n == N - 1 and tail:  # a last, partly filled mini-batch hands on its sums
            grads = Ka[n].transpose(-1, -2) @ (G * eta_s[n])
            if n == 0 and P is not None:
                grads += P
            break
        # docs/maths.md 2.3: W_b = W_0 - tau_b (carried sums + this call's)
        if n == 0 and P is not None:
            W.sub_(tau_b * P)
        W.baddbmm_(ku, G, alpha=-1)
    out = steps_to_output(Zbar, q, p, T, H, ln_weight, ln_bias, residual)
    W = W.unflatten(0, (B, H))
    return out, Carry(_split(W, has_bias),
                      None if grads is None else _split(grads.unflatten(0, (B, H)), has_bias), tail)


def ttt_mlp_dual(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor, checkpoint_group: int | None = None,
) -> tuple[torch.Tensor, Carry]:
    """TTT-MLP, f_res(z) = gelu(z W1 + b1) W2 + b2, in the dual form (the second layer's
    A2 = tril(Xbar2 X2^T) pairs the queries' hidden rows with the keys' hidden rows at W1_0).
    Returns (o [B, T, H, Dv], carry).

    The mini-batch scan is one autograd node with a hand-written backward pass (mlp_scan.py);
    ``checkpoint_group`` is its memory trade. Traced programs (torch.compile) take the plain
    PyTorch scan below it (``_ttt_mlp_dual_traced``), differentiated by autograd."""
    if torch.compiler.is_compiling():
        return _ttt_mlp_dual_traced(q, k, v, eta, carry, ln_weight, ln_bias, residual, tau,
                                    checkpoint_group)
    (B, T, H, Dk), b, p = q.shape, tau.shape[-1], carry.pos
    has_b1, has_b2 = carry.start[1] is not None, carry.start[3] is not None
    W1, W2 = (_join(*carry.start[i:i + 2]).flatten(0, 1) for i in (0, 2))  # [BH, ...]
    P1, P2 = (None, None) if carry.grads is None else (
        _join(*carry.grads[i:i + 2]).flatten(0, 1) for i in (0, 2))
    # Step-major [N, B*H, b, D] (common.to_steps): every step reads contiguous blocks.
    KQ = kq_steps(k, q, p, b, has_b1)  # [N, BH, 2b, Dk1]: keys, then queries
    target = to_steps(v, p, b)
    if residual:  # docs/maths.md 2.2: the residual moves into the target
        target = target - KQ[:, :, :b, :Dk]
    # Padding rows get eta = 0, so they never contribute to any gradient sum.
    eta_s = to_steps(eta.unsqueeze(-1), p, b).squeeze(-1)  # [N, BH, b]
    tau_r = tau.repeat(B, 1)  # [BH, b], per row of the steps' batch dim
    E = (tau_r.unsqueeze(-1) * eta_s.unsqueeze(-2)).tril()  # E_ij = tau_i eta_j, j <= i
    per_row = [None if w is None else w.repeat(B, 1) for w in (ln_weight, ln_bias)]
    tail = (p + T) % b
    Zbar, W1, W2, S1, S2 = mlp_scan(KQ, target, eta_s, E, tau_r, W1, W2, P1, P2, *per_row,
                                    has_b2, bool(tail), checkpoint_group)
    out = steps_to_output(Zbar, q, p, T, H, ln_weight, ln_bias, residual)
    W1, W2 = W1.unflatten(0, (B, H)), W2.unflatten(0, (B, H))
    grads = None if S1 is None else (
        _split(S1.unflatten(0, (B, H)), has_b1) + _split(S2.unflatten(0, (B, H)), has_b2))
    return out, Carry(_split(W1, has_b1) + _split(W2, has_b2), grads, tail)


def _ttt_mlp_dual_traced(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor, checkpoint_group: int | None = None,
) -> tuple[torch.Tensor, Carry]:
    """``ttt_mlp_dual`` as plain PyTorch operations (autograd differentiates the scan; with
    ``checkpoint_group`` each group of steps runs under torch.utils.checkpoint)."""
    T, b, p = q.shape[1], tau.shape[-1], carry.pos
    Q, K, target, eta_mb, E = _layout(q, k, v, eta, p, residual, tau)
    has_b1, has_b2 = carry.start[1] is not None, carry.start[3] is not None
    W1, W2 = _join(*carry.start[:2]), _join(*carry.start[2:])  # [B, H, Dk(+1), Dh], [B, H, Dh(+1), Dv]
    prior1, prior2 = (None, None) if carry.grads is None else (
        _join(*carry.grads[:2]), _join(*carry.grads[2:]))
    Dh = carry.start[0].shape[-1]
    Qa, Ka = _ones(Q, has_b1), _ones(K, has_b1)
    M1 = E * (Qa @ Ka.transpose(-1, -2))  # [B, H, N, b, b]
    KQ = torch.cat([Ka, Qa], dim=-2)
    KT_eta = (Ka * eta_mb.unsqueeze(-1)).transpose(-1, -2)  # [B, H, N, Dk(+1), b]
    tau_rows, tau_b = tau.unsqueeze(-1), per_head(tau[:, -1], W1)
    tail = (p + T) % b
    N = Q.shape[2]
    steps = list(zip(KQ.unbind(2), target.unbind(2), KT_eta.unbind(2), eta_mb.unbind(2), M1.unbind(2)))

    def run(n0: int, n1: int, W1: torch.Tensor, W2: torch.Tensor) -> tuple[Any, ...]:
        """Mini-batches n0..n1-1 from start weights (W1, W2): (W1, W2 after them, X2, Xbar2,
        G2, Zq2 [B, H, n, b, *], gradient sums of a trailing partial mini-batch or None)."""
        X2s, Xbar2s, G2s, zq2, grads = [], [], [], [], None
        for n in range(n0, n1):
            kq, tgt, kt_eta, eta_n, m1 = steps[n]
            Z = kq @ W1  # [B, H, 2b, Dh]
            Z1, Zq1 = Z[..., :b, :], Z[..., b:, :]
            X2 = _ones(gelu(Z1), has_b2)  # [B, H, b, Dh(+1)]
            G2 = loss_grad(X2 @ W2, tgt, ln_weight, ln_bias)  # [B, H, b, Dv]
            G1 = (G2 @ W2[..., :Dh, :].transpose(-1, -2)) * gelu_grad(Z1)  # [B, H, b, Dh]
            Zbar1 = Zq1 - m1 @ G1
            if n == 0 and prior1 is not None:
                Zbar1 = Zbar1 - tau_rows * (Qa[:, :, 0] @ prior1)
            Xbar2 = _ones(gelu(Zbar1), has_b2)
            Zq2 = Xbar2 @ W2  # [B, H, b, Dv]
            sums1 = kt_eta @ G1
            sums2 = (X2 * eta_n.unsqueeze(-1)).transpose(-1, -2) @ G2
            if n == 0 and prior2 is not None:
                Zq2 = Zq2 - tau_rows * (Xbar2 @ prior2)
                sums1, sums2 = sums1 + prior1, sums2 + prior2
            X2s.append(X2)
            Xbar2s.append(Xbar2)
            G2s.append(G2)
            zq2.append(Zq2)
            if n == N - 1 and tail:
                grads = _split(sums1, has_b1) + _split(sums2, has_b2)
            else:
                W1, W2 = W1 - tau_b * sums1, W2 - tau_b * sums2
        stacked = (torch.stack(x, dim=2) for x in (X2s, Xbar2s, G2s, zq2))
        return W1, W2, *stacked, grads

    W1, W2, X2, Xbar2, G2, zq2, grads = _scan(run, N, checkpoint_group, W1, W2)
    Zbar2 = zq2 - (E * (Xbar2 @ X2.transpose(-1, -2))) @ G2
    out = Zbar2 if ln_weight is None else layer_norm(Zbar2, ln_weight, ln_bias)
    if residual:
        out = out + Q
    return from_minibatches(out, p, T), Carry(
        _split(W1, has_b1) + _split(W2, has_b2), grads, tail)
