"""One-token form of TTT-Linear and TTT-MLP (docs/maths.md 2.3, one token at a time): what
``mode="dual"`` runs for T = 1, the decoding step.

The dual form would place the token in a zero-padded mini-batch of b rows and build its b x b
matrices; here the token is a row: its gradient at the mini-batch's start weights W_0 is added to
the running sums S = sum_j eta_j grad_j, and it reads with W_i = W_0 - tau_i S, i its position in
the mini-batch. Same arithmetic as the dual and primal forms, so it agrees with them to rounding.

A step is a short chain of small operations, so its cost is the number of passes over the inner
weights and the number of operations, not arithmetic: products are batched matrix products over
the B H rows with the bias added in the same call (``baddbmm``), the LayerNorm gradient is one
``native_layer_norm_backward`` call and the GELU derivative one ``gelu_backward`` call. The
public state needs S and the current weights W_i after every token; each is one fused
multiply-add pass (``addcmul``), and W_i is then read once more by the query.

This is one of TTT's two one-token forms, on purpose: the layers decode with the rows form of
decode.py, which never writes weights between commits. Through the op's fixed state (current
weights, start, sums, place) the rows form is slower than this one; for a layer's own state it
is faster (docs/performance.md, benchmarks/results/ttt_step_forms/).

Positions: ``carry.pos`` is one int for the whole batch, or a long tensor [B] with each row's own
place in its mini-batch (streams decoded together from different positions). A row whose
mini-batch completes commits W_i as its next start weights and clears its sums; rows at place 0
carry zero sums.

Dimension legend: B batch, H heads, Dk key/query dim, Dv value dim, Dh = 4 Dk (MLP hidden).
Inputs ``[B, 1, H, D]`` and eta ``[B, 1, H]`` in the compute dtype, tau ``[H, b]``, inner
weights ``[B, H, ...]`` in a ``Carry``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import LN_EPS, Carry, Weights, fused_ln_loss_grad


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H, *s] -> [B H, *s] (batched-product layout; a view for the states' layout)."""
    return x.reshape(-1, *x.shape[2:])


def _apply(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [BH, 1, Din] through W [B, H, Din, Dout] (+ b [B, H, Dout]) -> [BH, 1, Dout]."""
    if b is None:
        return torch.bmm(x, _rows(W))
    return torch.baddbmm(b.reshape(x.shape[0], 1, -1), x, _rows(W))


Norm = tuple[torch.Tensor, torch.Tensor | None] | None  # LayerNorm (gamma, beta) [H, 1, Dv]


def _norm(ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None) -> Norm:
    """The inner LayerNorm's affine parameters [H, Dv] laid out against rows [B, H, 1, Dv]."""
    if ln_weight is None:
        return None
    return ln_weight.unsqueeze(1), None if ln_bias is None else ln_bias.unsqueeze(1)


def _affine(x_hat: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    gamma, beta = norm
    return x_hat * gamma if beta is None else torch.addcmul(beta, x_hat, gamma)


def _loss_grad(z: torch.Tensor, target: torch.Tensor, norm: Norm) -> torch.Tensor:
    """dl/dZ of l = 1/2 ||[LN](Z) - target||^2 for rows z [B, H, 1, Dv] (``common.loss_grad``):
    with LayerNorm, g = gamma * (LN(Z) - target) taken back through the normalisation, which is
    exactly ``native_layer_norm_backward`` of g without an affine part."""
    if norm is None:
        return z - target
    return fused_ln_loss_grad(z, target, *norm)


def _finish(z: torch.Tensor, q: torch.Tensor, norm: Norm, residual: bool) -> torch.Tensor:
    """Output rows z [B, H, 1, Dv] -> o [B, 1, H, Dv]: LayerNorm (when given) and residual."""
    out = z if norm is None else _affine(F.layer_norm(z, z.shape[-1:], eps=LN_EPS), norm)
    if residual:
        out = out + q
    return out.transpose(1, 2)


def _learn(
    W: torch.Tensor, b: torch.Tensor | None, prior: Weights | None, x: torch.Tensor,
    eg: torch.Tensor, t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """One layer's running sums after this token and the weights it reads with:
    S_W = prior_W + x^T eg, S_b = prior_b + eg, W_i = W - t S_W, b_i = b - t S_b.
    W [B, H, Din, Dout], x [B, H, 1, Din], eg = eta * grad [B, H, 1, Dout], t = tau_i
    [B|1, H, 1, 1]. Returns (S_W, S_b, W_i, b_i) in the state layout."""
    xT = x.transpose(-1, -2)  # [B, H, Din, 1]
    # One fused multiply-add pass each over the [Din, Dout] matrices: the step's main cost.
    sW = xT * eg if prior is None else torch.addcmul(prior[0], xT, eg)  # [B, H, Din, Dout]
    Wi = torch.addcmul(W, t, sW, value=-1.0)
    if b is None:
        return sW, None, Wi, None
    eg, t = eg.view(b.shape), t.view(*t.shape[:2], 1)
    sb = eg if prior is None else eg + prior[1]
    return sW, sb, Wi, torch.addcmul(b, t, sb, value=-1.0)


def _place(carry: Carry, tau: torch.Tensor) -> torch.Tensor:
    """tau_i of the token for every row, [B|1, H, 1, 1] (i = the row's place in its mini-batch)."""
    if isinstance(carry.pos, int):
        return tau[:, carry.pos].view(1, -1, 1, 1)
    return tau.t()[carry.pos].view(*carry.pos.shape, -1, 1, 1)  # [B, H, 1, 1]


def _carry(carry: Carry, sums: Weights, current: Weights, b: int) -> tuple[Carry, Weights]:
    """The carry after the token (a completed mini-batch commits the current weights and clears
    its sums) and the current weights, which the public state leads with."""
    pos = carry.pos + 1
    if isinstance(pos, int):
        if pos == b:
            return Carry(current, None, 0), current
        return Carry(carry.start, sums, pos), current
    done = pos == b  # [B] rows whose mini-batch this token completes

    def rows(x: torch.Tensor) -> torch.Tensor:  # done, broadcast against x [B, ...]
        return done.view(-1, *[1] * (x.dim() - 1))

    start = tuple(None if w is None else torch.where(rows(w), c, w)
                  for w, c in zip(carry.start, current))
    cleared = tuple(None if s is None else s.masked_fill(rows(s), 0.0) for s in sums)
    return Carry(start, cleared, pos.masked_fill(done, 0)), current


def ttt_linear_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor,
) -> tuple[torch.Tensor, tuple[Carry, Weights]]:
    """TTT-Linear for one token. Returns (o [B, 1, H, Dv], (carry, current weights))."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, 1, D]
    e = eta.transpose(1, 2).unsqueeze(-1)  # [B, H, 1, 1]
    W, bias = carry.start
    t, norm = _place(carry, tau), _norm(ln_weight, ln_bias)
    z = _apply(_rows(k), W, bias).view(v.shape)
    G = _loss_grad(z, v - k if residual else v, norm)
    sW, sb, Wi, bi = _learn(W, bias, carry.grads, k, e * G, t)
    z = _apply(_rows(q), Wi, bi).view(v.shape)
    return _finish(z, q, norm, residual), _carry(carry, (sW, sb), (Wi, bi), tau.shape[-1])


def ttt_mlp_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor,
) -> tuple[torch.Tensor, tuple[Carry, Weights]]:
    """TTT-MLP for one token. Returns (o [B, 1, H, Dv], (carry, current weights))."""
    B, H = q.shape[0], q.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, 1, D]
    e = eta.transpose(1, 2).unsqueeze(-1)  # [B, H, 1, 1]
    W1, b1, W2, b2 = carry.start
    t, norm = _place(carry, tau), _norm(ln_weight, ln_bias)
    Z1 = _apply(_rows(k), W1, b1)  # [BH, 1, Dh]
    X2 = F.gelu(Z1, approximate="tanh")
    Z2 = _apply(X2, W2, b2).view(v.shape)
    G2 = _loss_grad(Z2, v - k if residual else v, norm)  # [B, H, 1, Dv]
    # dl/dZ1 = (G2 W2^T) * gelu'(Z1): gelu_backward is exactly that product for the tanh GELU.
    G1 = torch.ops.aten.gelu_backward(torch.bmm(_rows(G2), _rows(W2).transpose(-1, -2)), Z1,
                                      approximate="tanh")
    p1, p2 = (None, None) if carry.grads is None else (carry.grads[:2], carry.grads[2:])
    sW1, sb1, W1i, b1i = _learn(W1, b1, p1, k, e * G1.view(B, H, 1, -1), t)
    sW2, sb2, W2i, b2i = _learn(W2, b2, p2, X2.view(B, H, 1, -1), e * G2, t)
    z = _apply(F.gelu(_apply(_rows(q), W1i, b1i), approximate="tanh"), W2i, b2i).view(v.shape)
    return (_finish(z, q, norm, residual),
            _carry(carry, (sW1, sb1, sW2, sb2), (W1i, b1i, W2i, b2i), tau.shape[-1]))
