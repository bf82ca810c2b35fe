"""One token at a time (docs/maths.md 2.3), TTT's recurrent form: the one-token step of
TTT-Linear and TTT-MLP (what ``ttt_linear_step`` / ``ttt_mlp_step`` and the ops' one-token
calls run), and the rows an op call leaves for the open mini-batch (``rows_at``).

The open mini-batch is carried as rows (a ``TTTState``), never as materialised weights. Within
a mini-batch every gradient is taken at the start weights W_0, so the weights after token i are
W_i = W_0 - tau_i S_i with S_i = sum_{j<=i} x_j^T (eta_j g_j), a sum of rank-one terms. A query
reads x_q W_i = x_q W_0 - tau_i (x_q X^T) EG with X, EG the mini-batch's input rows and
eta-scaled output gradients so far (docs/maths.md 2.4's dual form, one row at a time); a bias
adds 1 to every coefficient (its input is 1). A step reads the start weights (TTT-MLP: [k; q]
through W1_0 in one product, then W2_0 for the key, its gradient and the query; TTT-Linear:
[k; q] through W_0) and writes weights only when a mini-batch completes (W_0 - tau_b X^T EG,
one product per matrix).

Places: ``pos`` is one int for the whole batch (the rows then hold pos tokens and grow by one
per step), or a long tensor [B] with each row's own place (b-row buffers, each token written
at its row's place by a one-hot). A row whose mini-batch completes commits its next start
weights and clears its rows: for an int place decided on the host; for per-row places the
completing rows are read back (eager), or, where nothing may be read back (``torch.compile``,
``torch.export``, a captured CUDA graph), every row's commit is formed and kept where it
completes (``commit="where"``).

Dimension legend: B batch, H heads, Dk key/query dim, Dv value dim, Dh = 4 Dk (MLP hidden),
b mini-batch size, r rows of the open mini-batch held (pos for one place, b for per-row
places). Inputs [B, 1, H, D] and eta [B, 1, H] in the compute dtype; tau [b] or [H, b].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .._modes import reads_allowed
from .common import LN_EPS, Rows, TTTState, Weights, empty_rows, fused_ln_loss_grad

Norm = tuple[torch.Tensor, torch.Tensor | None] | None  # LayerNorm (gamma, beta) [H, 1, Dv]
GroupNorm = tuple[torch.Tensor, torch.Tensor | None] | None  # (gamma, beta) [H * Dv] or None


def layer_norm_rows(ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None) -> Norm:
    """The inner LayerNorm's affine parameters [H, Dv] laid out against rows [B, H, n, Dv]."""
    if ln_weight is None:
        return None
    return ln_weight.unsqueeze(1), None if ln_bias is None else ln_bias.unsqueeze(1)


def _loss_grad(z: torch.Tensor, target: torch.Tensor, norm: Norm) -> torch.Tensor:
    """dl/dZ of l = 1/2 ||[LN](Z) - target||^2 for rows z [B, H, n, Dv] (``common.loss_grad``):
    with LayerNorm, g = gamma * (LN(Z) - target) taken back through the normalisation, which is
    exactly ``native_layer_norm_backward`` of g without an affine part."""
    if norm is None:
        return z - target
    return fused_ln_loss_grad(z, target, *norm)


def rows_at(kind: str, start: Weights, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor,
            norm: Norm, residual: bool) -> Rows:
    """The rows (X, EG per inner layer, [B, H, n, D]) of n tokens of one mini-batch whose start
    weights are ``start``: every token's inputs and eta * dl/d(output), all at ``start`` (what
    n one-token steps from the mini-batch's start would carry). k [B, n, H, Dk],
    v [B, n, H, Dv], eta [B, n, H], ``norm`` from ``layer_norm_rows``; compute dtype."""
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [B, H, n, D]
    e = eta.transpose(1, 2).unsqueeze(-1)  # [B, H, n, 1]
    target = vh - kh if residual else vh
    if kind == "linear":
        W, bias = start
        z = kh @ W if bias is None else kh @ W + bias.unsqueeze(2)
        return kh, e * _loss_grad(z, target, norm)
    W1, b1, W2, b2 = start
    Z1 = kh @ W1 if b1 is None else kh @ W1 + b1.unsqueeze(2)
    X2 = F.gelu(Z1, approximate="tanh")
    Z2 = X2 @ W2 if b2 is None else X2 @ W2 + b2.unsqueeze(2)
    G2 = _loss_grad(Z2, target, norm)
    G1 = torch.ops.aten.gelu_backward(G2 @ W2.transpose(-1, -2), Z1, approximate="tanh")
    return kh, e * G1, X2, e * G2


def _append(rows: torch.Tensor, x: torch.Tensor, hot: torch.Tensor | None) -> torch.Tensor:
    """rows [B, H, r, D] with x [B, H, 1, D] as its next row: appended (one place for all
    rows) or written at each row's place (``hot`` [B, 1, b, 1], the rows there are zero)."""
    if hot is not None:
        return torch.addcmul(rows, hot, x)
    return x if rows.shape[2] == 0 else torch.cat([rows, x], dim=2)


def _read(x: torch.Tensor, z0: torch.Tensor, X: torch.Tensor, EG: torch.Tensor, bias: bool,
          t: torch.Tensor | float) -> torch.Tensor:
    """x W_i + b_i for rows x [BH, 1, Din] given z0 = x W_0 + b_0 [BH, 1, Dout]:
    z0 - t (x X^T [+ 1]) EG, X [B, H, r, Din], EG [B, H, r, Dout], t [BH, 1, 1] or a
    number."""
    coef = torch.bmm(x, X.flatten(0, 1).transpose(1, 2))  # [BH, 1, r]
    if bias:
        coef = coef + 1.0  # a bias's input is 1 (rows not yet written have EG = 0)
    if isinstance(t, float):  # tau_i known as a number: folded into the product
        return torch.baddbmm(z0, coef, EG.flatten(0, 1), alpha=-t)
    return torch.addcmul(z0, t, torch.bmm(coef, EG.flatten(0, 1)), value=-1.0)


def _committed(start: Weights, rows: Rows, t: torch.Tensor) -> Weights:
    """W_0 - t X^T EG for every inner weight (the next mini-batch's start); t a scalar or [H].
    One product per matrix writes the new weights (X^T (-t EG) added to W_0 in the same
    call): each fresh matrix is one new allocation, not three."""
    tt = t.view(1, -1, 1, 1) if t.dim() else t
    out: list[torch.Tensor | None] = []
    for i in range(0, len(start), 2):
        W, bias = start[i], start[i + 1]
        X, EG = rows[i], rows[i + 1]
        EGs = EG * -tt  # [B, H, r, Dout], small
        W = torch.baddbmm(W.flatten(0, 1), X.flatten(0, 1).transpose(1, 2),
                          EGs.flatten(0, 1)).view(W.shape)
        out += [W, None if bias is None else bias + EGs.sum(2)]
    return tuple(out)


def _commit(state: TTTState, rows: Rows, tau: torch.Tensor, b: int,
            commit: str) -> TTTState | Weights:
    """The state after the token, ``rows`` holding it: a mini-batch the token completes makes
    W_0 - tau_b S its next start weights and clears its rows (an int place: the weights
    themselves, the state at a boundary)."""
    pos = state.pos + 1
    t = tau[..., b - 1]  # a scalar, or [H]
    if isinstance(pos, int):
        return TTTState(state.start, rows, pos) if pos < b else _committed(state.start, rows, t)
    done = pos == b  # [B] rows whose mini-batch this token completes
    if commit == "where" or not reads_allowed():
        return _commit_where(state.start, rows, done, pos, t)
    return _commit_rows(state.start, rows, done, pos, t)


def _commit_rows(start: Weights, rows: Rows, done: torch.Tensor, pos: torch.Tensor,
                 t: torch.Tensor) -> TTTState:
    """``_commit`` for per-row places: the rows ``done`` completes (read back to the host) get
    their committed weights; the others are kept as they are."""
    idx = done.nonzero().squeeze(1)
    if idx.numel() == 0:
        return TTTState(start, rows, pos)

    def pick(items: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        return tuple(None if w is None else w.index_select(0, idx) for w in items)

    # Only the completing rows: index them out, update, write back (one copy of each tensor).
    new = _committed(pick(start), pick(rows), t)
    start = tuple(None if w is None else w.index_copy(0, idx, n) for w, n in zip(start, new))
    rows = tuple(r.index_fill(0, idx, 0.0) for r in rows)
    return TTTState(start, rows, pos.masked_fill(done, 0))


def _commit_where(start: Weights, rows: Rows, done: torch.Tensor, pos: torch.Tensor,
                  t: torch.Tensor) -> TTTState:
    """``_commit`` for per-row places without reading ``done`` back: every row's committed
    weights are formed and kept where the row completes (no data-dependent branch, no shape
    that depends on the data)."""
    def where(x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return torch.where(done.view(-1, *[1] * (x.dim() - 1)), new, x)

    new = _committed(start, rows, t)
    start = tuple(None if w is None else where(w, n) for w, n in zip(start, new))
    rows = tuple(r.masked_fill(done.view(-1, 1, 1, 1), 0.0) for r in rows)
    return TTTState(start, rows, pos.masked_fill(done, 0))


def _scales(state: TTTState, tau: torch.Tensor, eta: torch.Tensor, B: int, H: int, b: int,
            values: Sequence[float] | None = None
            ) -> tuple[torch.Tensor | float, torch.Tensor, torch.Tensor | None]:
    """(t, e, hot): the token's tau_i as a scalar tensor, [BH, 1, 1] or (given ``values``, tau's
    entries as floats, and one place for every row) a float, eta as [BH, 1, 1] and, for per-row
    places, the one-hot [B, 1, b, 1] of each row's place (else None)."""
    e = eta.reshape(B * H, 1, 1)
    if isinstance(state.pos, int):
        if values is not None:
            return values[state.pos], e, None
        t = tau[state.pos] if tau.dim() == 1 else tau[:, state.pos].repeat(B).view(-1, 1, 1)
        return t, e, None
    pos = state.pos
    t = (tau[pos].unsqueeze(1) if tau.dim() == 1 else tau.t()[pos]).expand(B, H).reshape(-1, 1, 1)
    hot = (torch.arange(b, device=pos.device) == pos.unsqueeze(1)).to(e.dtype).view(-1, 1, b, 1)
    return t, e, hot


def group_norm(ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None) -> GroupNorm:
    """The inner LayerNorm's affine parameters [H, Dv] as one group norm's [H * Dv]: a
    LayerNorm per head over a token's H * Dv values is a group norm with H groups."""
    if ln_weight is None:
        return None
    return ln_weight.reshape(-1), None if ln_bias is None else ln_bias.reshape(-1)


def _norm_grad(z: torch.Tensor, target: torch.Tensor, gn: GroupNorm, B: int, H: int
               ) -> torch.Tensor:
    """dl/dZ of l = 1/2 ||[LN](Z) - target||^2 for rows z [BH, 1, Dv], target [B, 1, H, Dv] (as
    ``common.loss_grad``): LN(Z) - target taken back through the affine normalisation, here one
    group norm forward and its backward kernel over the token's heads (without gradients
    recorded; the group norm's backward kernel has no derivative, so with them the LayerNorm
    kernels of ``_loss_grad``)."""
    if gn is None:
        return z - target.reshape(z.shape)
    Dv = z.shape[-1]
    if torch.is_grad_enabled():
        norm = (gn[0].view(H, 1, Dv), None if gn[1] is None else gn[1].view(H, 1, Dv))
        return _loss_grad(z.view(B, H, 1, Dv), target.reshape(B, H, 1, Dv), norm).view(
            B * H, 1, Dv)
    zf = z.reshape(B, H * Dv)
    y, mean, rstd = torch.native_group_norm(zf, gn[0], gn[1], B, H * Dv, 1, H, LN_EPS)
    dz = torch.ops.aten.native_group_norm_backward(
        y - target.reshape(B, H * Dv), zf, mean, rstd, gn[0], B, H * Dv, 1, H,
        [True, False, False])[0]
    return dz.view(B * H, 1, Dv)


def _out(z: torch.Tensor, q: torch.Tensor, gn: GroupNorm, residual: bool, B: int, H: int
         ) -> torch.Tensor:
    """Rows z [BH, 1, Dv] -> o [B, 1, H, Dv]: LayerNorm per head (when given, as a group norm
    with H groups) and the residual q [B, 1, H, Dk]."""
    out = z.reshape(B, -1)
    if gn is not None:
        # torch.group_norm, not F.group_norm: the latter refuses one value per group (Dv = 1, B = 1)
        out = torch.group_norm(out, H, gn[0], gn[1], LN_EPS)
    if residual:
        out = out + q.reshape(B, -1)
    return out.view(B, 1, H, -1)


def _bias_rows(w: torch.Tensor | None, BH: int) -> torch.Tensor | None:
    return None if w is None else w.reshape(BH, 1, -1)


def linear_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor,
                 state: TTTState, norm: GroupNorm, residual: bool, tau: torch.Tensor,
                 values: Sequence[float] | None = None, commit: str = "read",
                 ) -> tuple[torch.Tensor, TTTState | Weights]:
    """TTT-Linear, one token: q, k [B, 1, H, Dk], v [B, 1, H, Dv], eta [B, 1, H]; ``values``
    tau's entries as floats (or None); ``commit`` "read" or "where" (see the module
    docstring)."""
    B, _, H, Dk = q.shape
    BH, b = B * H, tau.shape[-1]
    W, bias = state.start
    t, e, hot = _scales(state, tau, eta, B, H, b, values)
    kq = torch.stack([k, q], dim=3).view(BH, 2, Dk)  # per (batch, head): the key, the query
    z = torch.baddbmm(bias.reshape(BH, 1, -1), kq, W.flatten(0, 1)) if bias is not None \
        else torch.bmm(kq, W.flatten(0, 1))  # [BH, 2, Dv]
    # narrow, not Tensor.split: the Python wrapper of split costs a step more than two views
    kr, qr = kq.narrow(1, 0, 1), kq.narrow(1, 1, 1)
    zk, zq = z.narrow(1, 0, 1), z.narrow(1, 1, 1)
    eg = e * _norm_grad(zk, v - k if residual else v, norm, B, H)
    X, EG = (_append(state.rows[0], kr.view(B, H, 1, Dk), hot),
             _append(state.rows[1], eg.view(B, H, 1, -1), hot))
    zq = _read(qr, zq, X, EG, bias is not None, t)
    return _out(zq, q, norm, residual, B, H), _commit(state, (X, EG), tau, b, commit)


def mlp_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor,
              state: TTTState, norm: GroupNorm, residual: bool, tau: torch.Tensor,
              values: Sequence[float] | None = None, commit: str = "read",
              ) -> tuple[torch.Tensor, TTTState | Weights]:
    """TTT-MLP, one token (arguments as ``linear_token``)."""
    B, _, H, Dk = q.shape
    BH, b = B * H, tau.shape[-1]
    W1, b1, W2, b2 = state.start
    W1r, W2r, b2r = W1.flatten(0, 1), W2.flatten(0, 1), _bias_rows(b2, BH)
    t, e, hot = _scales(state, tau, eta, B, H, b, values)
    kq = torch.stack([k, q], dim=3).view(BH, 2, Dk)  # per (batch, head): the key, the query
    Z1 = torch.baddbmm(b1.reshape(BH, 1, -1), kq, W1r) if b1 is not None else torch.bmm(kq, W1r)
    kr, qr = kq.narrow(1, 0, 1), kq.narrow(1, 1, 1)  # views (see linear_token)
    Z1k, Z1q = Z1.narrow(1, 0, 1), Z1.narrow(1, 1, 1)  # [BH, 1, Dh] each
    X2 = F.gelu(Z1k, approximate="tanh")
    Z2 = torch.baddbmm(b2r, X2, W2r) if b2 is not None else torch.bmm(X2, W2r)
    G2 = _norm_grad(Z2, v - k if residual else v, norm, B, H)  # [BH, 1, Dv]
    # dl/dZ1 = (G2 W2^T) * gelu'(Z1): gelu_backward is exactly that product for the tanh GELU.
    G1 = torch.ops.aten.gelu_backward(torch.bmm(G2, W2r.transpose(1, 2)), Z1k, approximate="tanh")
    rows = state.rows
    X1s = _append(rows[0], kr.view(B, H, 1, Dk), hot)
    EG1s = _append(rows[1], (e * G1).view(B, H, 1, -1), hot)
    X2s = _append(rows[2], X2.view(B, H, 1, -1), hot)
    EG2s = _append(rows[3], (e * G2).view(B, H, 1, -1), hot)
    z1 = _read(qr, Z1q, X1s, EG1s, b1 is not None, t)
    x2 = F.gelu(z1, approximate="tanh")
    z2 = torch.baddbmm(b2r, x2, W2r) if b2 is not None else torch.bmm(x2, W2r)
    z2 = _read(x2, z2, X2s, EG2s, b2 is not None, t)
    return _out(z2, q, norm, residual, B, H), _commit(state, (X1s, EG1s, X2s, EG2s), tau, b,
                                                      commit)


def with_rows(start: Weights) -> TTTState:
    """The weights at a mini-batch boundary as a ``TTTState`` without rows (place 0)."""
    return TTTState(tuple(start), empty_rows(tuple(start)), 0)


def state_after(kind: str, start: Weights, pos: int, state_in: Any, k: torch.Tensor,
                v: torch.Tensor, eta: torch.Tensor, norm: Norm, residual: bool
                ) -> TTTState | Weights:
    """An op call's final state from its last mini-batch's start weights ``start`` and place
    ``pos`` (the parallel forms' carry): the weights at a boundary (pos 0), else a ``TTTState``
    whose rows are the open mini-batch's tokens: this call's last min(pos, T) tokens (k, v, eta
    [B, T, ...], compute dtype), computed at ``start``, after those ``state_in`` (the call's
    checked initial state) held where the mini-batch began before the call."""
    if pos == 0:
        return tuple(start)
    T = k.shape[1]
    m = min(pos, T)
    rows = rows_at(kind, start, k[:, T - m:], v[:, T - m:], eta[:, T - m:], norm, residual)
    if m < pos:  # the mini-batch began before the call: its first rows are state_in's
        rows = tuple(torch.cat([r0, r], dim=2) for r0, r in zip(state_in.rows, rows))
    return TTTState(tuple(start), rows, pos)


__all__ = ["GroupNorm", "Norm", "group_norm", "layer_norm_rows", "linear_token", "mlp_token",
           "rows_at", "state_after", "with_rows"]
