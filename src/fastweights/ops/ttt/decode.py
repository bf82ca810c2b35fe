"""The TTT layers' decoding step (docs/maths.md 2.3, one token at a time) in the dual form's terms:
the current mini-batch is carried as rows, never as materialised weights.

Within a mini-batch every gradient is taken at the start weights W_0, so the weights after
token i are W_i = W_0 - tau_i S_i with S_i = sum_{j<=i} x_j^T (eta_j g_j), a sum of rank-one
terms. A query reads x_q W_i = x_q W_0 - tau_i (x_q X^T) EG with X, EG the mini-batch's input
rows and eta-scaled output gradients so far (docs/maths.md 2.4's dual form, one row at a time); a
bias adds 1 to every coefficient (its input is 1). The public ops' step (step.py) must return the
current weights after every token, which costs ~15 passes over the inner weights per token for
TTT-MLP (the sums and W_i are rewritten each time); this form reads the start weights four times
(TTT-MLP: [k; q] through W1_0 in one product, then W2_0 for the key, its gradient and the query)
and two for TTT-Linear, and writes weights only when a mini-batch completes. Against step.py's
weights form it is faster per token for a batch of streams and slower if converted back to the op
state every token (docs/performance.md, benchmarks/results/ttt_step_forms/), which is why the
public ops keep step.py for T = 1.

``DecodeCarry`` is a layer state, not an op state: the public ops' states stay as
docs/design.md, "State layouts", fixes them (current weights first). ``to_op_state`` turns a
carry back into one, ``decode_carry`` turns an op state (or the learned initial weights) into one;
an op state that ends inside a mini-batch holds only its sums, which the carry keeps as ``prior``
until that mini-batch completes.

Dimension legend: B batch, H heads, Dk key/query dim, Dv value dim, Dh = 4 Dk (MLP hidden),
b mini-batch size, r rows of the current mini-batch held (pos for one place, b for per-row
places).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..._checks import state_dtype
from .._autocast import float32_compute
from ..backend import Kernel, Trial, register
from .common import LN_EPS, Carry, Weights, to_dtype
from .kernels import decode_kernels, head_size_refusal, triton_chosen
from .step import _loss_grad, _norm

Rows = tuple[torch.Tensor, ...]  # per inner layer (X [B, H, r, Din], EG [B, H, r, Dout])


class DecodeCarry(NamedTuple):
    """A TTT layer's inner state between decoding steps.

    start: weights at the start of the current mini-batch, [B, H, ...] (biases may be None).
    prior: gradient sums the carry was given by an op state that ended inside a mini-batch
        (same layout as ``start``), or None; zero in rows whose mini-batch has since completed.
    rows: (X, EG) per inner layer (TTT-Linear one, TTT-MLP two): the inputs [B, H, r, Din] and
        eta * dl/d(output) [B, H, r, Dout] of the tokens of the current mini-batch consumed here.
        With an int ``pos`` they hold the pos - (tokens covered by ``prior``) newest tokens;
        with per-row places they are [B, H, b, D] buffers, zero in rows not yet written.
    pos: tokens of the current mini-batch consumed, an int in [0, b) or a long tensor [B].
    prior_steps: steps after which ``prior`` is zero in every row (it is then dropped).
    """

    start: Weights
    prior: Weights | None
    rows: Rows
    pos: int | torch.Tensor
    prior_steps: int

    def sums(self) -> Weights:
        """The gradient sums S of the current mini-batch so far (``prior`` + X^T EG), biases'
        sums EG summed over rows; the op states' ``grads``."""
        out = []
        for i, w in enumerate(self.start):
            X, EG = self.rows[i // 2 * 2], self.rows[i // 2 * 2 + 1]
            if w is None:
                out.append(None)
                continue
            s = EG.sum(2) if i % 2 else X.transpose(-1, -2) @ EG
            out.append(s if self.prior is None else s + self.prior[i])
        return tuple(out)


def _empty_rows(start: Weights, n_layers: int, r: int) -> Rows:
    """Zero rows [B, H, r, D] for every inner layer's inputs and output gradients."""
    rows = []
    for w in start[::2][:n_layers]:
        B, H, Din, Dout = w.shape
        rows += [w.new_zeros(B, H, r, Din), w.new_zeros(B, H, r, Dout)]
    return tuple(rows)


def decode_carry(state: Any, kind: str, B: int, H: int, Dk: int, Dv: int, b: int,
                 q: torch.Tensor) -> DecodeCarry:
    """``state`` as a DecodeCarry: a DecodeCarry as it is, or an op state / initial weights
    (checked by ``Carry.check``, a batch of 1 broadcast) without rows."""
    if isinstance(state, DecodeCarry):
        n = state.start[0].shape[0]
        if n == B:
            return state
        if n != 1 or isinstance(state.pos, torch.Tensor):
            raise ValueError(f"a TTT decoding state of batch {n} cannot continue a batch of {B} "
                             "(only a batch of 1 broadcasts)")

        def grow(items: Any) -> Any:
            return None if items is None else tuple(
                None if x is None else x.expand(B, *x.shape[1:]) for x in items)

        return DecodeCarry(grow(state.start), grow(state.prior), grow(state.rows), state.pos,
                           state.prior_steps)
    carry = Carry.check(state, kind, B, H, Dk, Dv, b, q)
    n_layers = len(carry.start) // 2
    per_row = isinstance(carry.pos, torch.Tensor)
    rows = _empty_rows(carry.start, n_layers, b if per_row else 0)
    if carry.grads is None:
        return DecodeCarry(carry.start, None, rows, carry.pos, 0)
    steps = b - (int(carry.pos.min()) if per_row else carry.pos)
    return DecodeCarry(carry.start, carry.grads, rows, carry.pos, steps)


def to_op_state(carry: DecodeCarry, tau: torch.Tensor) -> tuple[Any, ...]:
    """The op state (``ttt_linear`` / ``ttt_mlp`` layout) equal to ``carry``; tau [b] or [H, b]."""
    per_row = isinstance(carry.pos, torch.Tensor)
    if not per_row and carry.pos == 0:
        return carry.start
    tau = tau.to(carry.start[0].dtype)
    tau = tau if tau.dim() == 2 else tau.expand(carry.start[0].shape[1], -1)
    return Carry(carry.start, carry.sums(), carry.pos).final_state(tau)


def stack_decode_carries(carries: Sequence[DecodeCarry], b: int) -> DecodeCarry:
    """One carry whose row i continues ``carries[i]`` (batch B_i each) at its own place: per-row
    places (long tensor [sum B_i]), rows padded to b-row buffers, ``prior`` zero where absent."""
    def buffer(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if isinstance(p, torch.Tensor) or x.shape[2] == b:
            return x
        return F.pad(x, (0, 0, 0, b - x.shape[2]))

    def cat(items: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if items[0] is None else torch.cat(items)

    start = tuple(cat([c.start[i] for c in carries]) for i in range(len(carries[0].start)))
    rows = tuple(cat([buffer(c.rows[i], c.pos) for c in carries])
                 for i in range(len(carries[0].rows)))
    prior = None
    if any(c.prior is not None for c in carries):
        prior = tuple(None if w is None else cat(
            [torch.zeros_like(c.start[i]) if c.prior is None else c.prior[i] for c in carries])
            for i, w in enumerate(carries[0].start))
    device = carries[0].start[0].device
    pos = torch.cat([torch.as_tensor(c.pos, device=device, dtype=torch.long).reshape(-1).expand(
        c.start[0].shape[0]) for c in carries])
    return DecodeCarry(start, prior, rows, pos, max(c.prior_steps for c in carries))


def _append(rows: torch.Tensor, x: torch.Tensor, hot: torch.Tensor | None) -> torch.Tensor:
    """rows [B, H, r, D] with x [B, H, 1, D] as its next row: appended (one place for all
    rows) or written at each row's place (``hot`` [B, 1, b, 1], the rows there are zero)."""
    if hot is not None:
        return torch.addcmul(rows, hot, x)
    return x if rows.shape[2] == 0 else torch.cat([rows, x], dim=2)


def _read(x: torch.Tensor, z0: torch.Tensor, X: torch.Tensor, EG: torch.Tensor, bias: bool,
          prior: tuple[torch.Tensor, torch.Tensor | None] | None,
          t: torch.Tensor | float) -> torch.Tensor:
    """x W_i + b_i for rows x [BH, 1, Din] given z0 = x W_0 + b_0 [BH, 1, Dout]:
    z0 - t (x S_prior + s_prior + (x X^T [+ 1]) EG), X [B, H, r, Din], EG [B, H, r, Dout],
    t [BH, 1, 1] or a scalar."""
    coef = torch.bmm(x, X.flatten(0, 1).transpose(1, 2))  # [BH, 1, r]
    if bias:
        coef = coef + 1.0  # a bias's input is 1 (rows not yet written have EG = 0)
    if isinstance(t, float):  # tau_i known as a number: folded into the product
        if prior is None:
            return torch.baddbmm(z0, coef, EG.flatten(0, 1), alpha=-t)
        corr = torch.baddbmm(_prior_read(x, prior), coef, EG.flatten(0, 1))
        return torch.add(z0, corr, alpha=-t)
    if prior is None:
        corr = torch.bmm(coef, EG.flatten(0, 1))
    else:
        corr = torch.baddbmm(_prior_read(x, prior), coef, EG.flatten(0, 1))
    return torch.addcmul(z0, t, corr, value=-1.0)


def _prior_read(x: torch.Tensor, prior: tuple[torch.Tensor, torch.Tensor | None]
                ) -> torch.Tensor:
    """x S_prior + s_prior for rows x [BH, 1, Din]."""
    pW, pb = prior
    if pb is None:
        return torch.bmm(x, pW.flatten(0, 1))
    return torch.baddbmm(pb.reshape(x.shape[0], 1, -1), x, pW.flatten(0, 1))


def _committed(start: Weights, prior: Weights | None, rows: Rows, t: torch.Tensor) -> Weights:
    """W_0 - t S for every inner weight (the next mini-batch's start), S = prior + X^T EG; t a
    scalar or [H]. One product per matrix writes the new weights (X^T (-t EG) added to W_0 in
    the same call): each fresh matrix is one new allocation, not three."""
    tt = t.view(1, -1, 1, 1) if t.dim() else t
    out: list[torch.Tensor | None] = []
    for i in range(0, len(start), 2):
        W, bias = start[i], start[i + 1]
        X, EG = rows[i], rows[i + 1]
        EGs = EG * -tt  # [B, H, r, Dout], small
        if prior is not None:
            W = torch.addcmul(W, tt, prior[i], value=-1.0)
        W = torch.baddbmm(W.flatten(0, 1), X.flatten(0, 1).transpose(1, 2),
                          EGs.flatten(0, 1)).view(W.shape)
        if bias is not None:
            bias = bias + EGs.sum(2)
            if prior is not None:
                bias = torch.addcmul(bias, tt.view(*tt.shape[:-1]) if t.dim() else tt,
                                     prior[i + 1], value=-1.0)
        out += [W, bias]
    return tuple(out)


def _commit(carry: DecodeCarry, rows: Rows, tau: torch.Tensor, b: int) -> DecodeCarry:
    """The carry after the token, ``rows`` holding it: a mini-batch the token completes makes
    W_0 - tau_b S its next start weights and clears its rows (and prior)."""
    pos = carry.pos + 1
    prior, steps = carry.prior, carry.prior_steps - 1
    if steps <= 0:
        prior, steps = None, 0  # zero in every row by now
    t = tau[..., b - 1]  # a scalar, or [H]
    if isinstance(pos, int):
        if pos < b:
            return DecodeCarry(carry.start, prior, rows, pos, steps)
        start = _committed(carry.start, carry.prior, rows, t)
        return DecodeCarry(start, None, _empty_rows(start, len(rows) // 2, 0), 0, 0)
    done = pos == b  # [B] rows whose mini-batch this token completes
    if torch.compiler.is_exporting():
        return _commit_where(carry, rows, prior, done, pos, t, steps)
    if torch.compiler.is_compiling():
        # torch.compile: the commit runs eagerly (a graph break), so a compiled step forms
        # committed weights only for the rows that complete, as the eager step does.
        return _commit_rows_eagerly()(carry, rows, prior, done, pos, t, steps)
    return _commit_rows(carry, rows, prior, done, pos, t, steps)


def _commit_rows(carry: DecodeCarry, rows: Rows, prior: Weights | None, done: torch.Tensor,
                 pos: torch.Tensor, t: torch.Tensor, steps: int) -> DecodeCarry:
    """``_commit`` for per-row places: the rows ``done`` completes (read on the host) get their
    committed weights; the others are copied as they are."""
    idx = done.nonzero().squeeze(1)
    if idx.numel() == 0:
        return DecodeCarry(carry.start, prior, rows, pos, steps)

    def pick(items: Any) -> Any:
        return None if items is None else tuple(
            None if w is None else w.index_select(0, idx) for w in items)

    # Only the completing rows: index them out, update, write back (one copy of each tensor).
    new = _committed(pick(carry.start), pick(carry.prior), pick(rows), t)
    start = tuple(None if w is None else w.index_copy(0, idx, n)
                  for w, n in zip(carry.start, new))
    rows = tuple(r.index_fill(0, idx, 0.0) for r in rows)
    if prior is not None:
        prior = tuple(None if w is None else w.index_fill(0, idx, 0.0) for w in prior)
    return DecodeCarry(start, prior, rows, pos.masked_fill(done, 0), steps)


_EAGER: list[Any] = []  # _commit_rows behind torch.compiler.disable, made on first use


def _commit_rows_eagerly() -> Any:
    """``_commit_rows`` as a graph break of torch.compile. Made when first needed (only ever
    under compilation): ``torch.compiler.disable`` imports torch._dynamo, which would add
    seconds to importing the library for everyone."""
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(_commit_rows))
    return _EAGER[0]


def _commit_where(carry: DecodeCarry, rows: Rows, prior: Weights | None, done: torch.Tensor,
                  pos: torch.Tensor, t: torch.Tensor, steps: int) -> DecodeCarry:
    """``_commit`` for per-row places without reading ``done`` on the host (an exported step,
    which has no graph breaks): every row's committed weights are formed and kept where the
    row completes."""
    def where(x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return torch.where(done.view(-1, *[1] * (x.dim() - 1)), new, x)

    new = _committed(carry.start, carry.prior, rows, t)
    start = tuple(None if w is None else where(w, n) for w, n in zip(carry.start, new))
    rows = tuple(where(r, torch.zeros_like(r)) for r in rows)
    if prior is not None:
        prior = tuple(None if w is None else where(w, torch.zeros_like(w)) for w in prior)
    return DecodeCarry(start, prior, rows, pos.masked_fill(done, 0), steps)


def _scales(carry: DecodeCarry, tau: torch.Tensor, eta: torch.Tensor, B: int, H: int, b: int,
            values: Sequence[float] | None = None
            ) -> tuple[torch.Tensor | float, torch.Tensor, torch.Tensor | None]:
    """(t, e, hot): the token's tau_i as a scalar tensor, [BH, 1, 1] or (given ``values``, tau's
    entries as floats, and one place for every row) a float, eta as [BH, 1, 1] and, for per-row
    places, the one-hot [B, 1, b, 1] of each row's place (else None)."""
    e = eta.reshape(B * H, 1, 1)
    if isinstance(carry.pos, int):
        if values is not None:
            return values[carry.pos], e, None
        t = tau[carry.pos] if tau.dim() == 1 else tau[:, carry.pos].repeat(B).view(-1, 1, 1)
        return t, e, None
    pos = carry.pos
    t = (tau[pos].unsqueeze(1) if tau.dim() == 1 else tau.t()[pos]).expand(B, H).reshape(-1, 1, 1)
    hot = (torch.arange(b, device=pos.device) == pos.unsqueeze(1)).to(e.dtype).view(-1, 1, b, 1)
    return t, e, hot


GroupNorm = tuple[torch.Tensor, torch.Tensor | None] | None  # (gamma, beta) [H * Dv] or None


def _group_norm(ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None) -> GroupNorm:
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
    kernels of ``step._loss_grad``)."""
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
        out = F.group_norm(out, H, gn[0], gn[1], LN_EPS)
    if residual:
        out = out + q.reshape(B, -1)
    return out.view(B, 1, H, -1)


def _bias_rows(w: torch.Tensor | None, BH: int) -> torch.Tensor | None:
    return None if w is None else w.reshape(BH, 1, -1)


def _linear_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor,
                 carry: DecodeCarry, norm: Any, residual: bool, tau: torch.Tensor,
                 values: Sequence[float] | None = None) -> tuple[torch.Tensor, DecodeCarry]:
    """TTT-Linear, one token: q, k [B, 1, H, Dk], v [B, 1, H, Dv], eta [B, 1, H]; ``values``
    tau's entries as floats (or None)."""
    B, _, H, Dk = q.shape
    BH, b = B * H, tau.shape[-1]
    W, bias = carry.start
    t, e, hot = _scales(carry, tau, eta, B, H, b, values)
    kq = torch.stack([k, q], dim=3).view(BH, 2, Dk)  # per (batch, head): the key, the query
    z = torch.baddbmm(bias.reshape(BH, 1, -1), kq, W.flatten(0, 1)) if bias is not None \
        else torch.bmm(kq, W.flatten(0, 1))  # [BH, 2, Dv]
    # narrow, not Tensor.split: the Python wrapper of split costs a step more than two views
    kr, qr = kq.narrow(1, 0, 1), kq.narrow(1, 1, 1)
    zk, zq = z.narrow(1, 0, 1), z.narrow(1, 1, 1)
    eg = e * _norm_grad(zk, v - k if residual else v, norm, B, H)
    X, EG = (_append(carry.rows[0], kr.view(B, H, 1, Dk), hot),
             _append(carry.rows[1], eg.view(B, H, 1, -1), hot))
    zq = _read(qr, zq, X, EG, bias is not None, _prior(carry, 0), t)
    return _out(zq, q, norm, residual, B, H), _commit(carry, (X, EG), tau, b)


def _prior(carry: DecodeCarry, layer: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    return None if carry.prior is None else (carry.prior[2 * layer], carry.prior[2 * layer + 1])


def _mlp_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor,
              carry: DecodeCarry, norm: Any, residual: bool, tau: torch.Tensor,
              values: Sequence[float] | None = None) -> tuple[torch.Tensor, DecodeCarry]:
    """TTT-MLP, one token (arguments as ``_linear_step``)."""
    B, _, H, Dk = q.shape
    BH, b = B * H, tau.shape[-1]
    W1, b1, W2, b2 = carry.start
    W1r, W2r, b2r = W1.flatten(0, 1), W2.flatten(0, 1), _bias_rows(b2, BH)
    t, e, hot = _scales(carry, tau, eta, B, H, b, values)
    kq = torch.stack([k, q], dim=3).view(BH, 2, Dk)  # per (batch, head): the key, the query
    Z1 = torch.baddbmm(b1.reshape(BH, 1, -1), kq, W1r) if b1 is not None else torch.bmm(kq, W1r)
    kr, qr = kq.narrow(1, 0, 1), kq.narrow(1, 1, 1)  # views (see _linear_step)
    Z1k, Z1q = Z1.narrow(1, 0, 1), Z1.narrow(1, 1, 1)  # [BH, 1, Dh] each
    X2 = F.gelu(Z1k, approximate="tanh")
    Z2 = torch.baddbmm(b2r, X2, W2r) if b2 is not None else torch.bmm(X2, W2r)
    G2 = _norm_grad(Z2, v - k if residual else v, norm, B, H)  # [BH, 1, Dv]
    # dl/dZ1 = (G2 W2^T) * gelu'(Z1): gelu_backward is exactly that product for the tanh GELU.
    G1 = torch.ops.aten.gelu_backward(torch.bmm(G2, W2r.transpose(1, 2)), Z1k, approximate="tanh")
    rows = carry.rows
    X1s = _append(rows[0], kr.view(B, H, 1, Dk), hot)
    EG1s = _append(rows[1], (e * G1).view(B, H, 1, -1), hot)
    X2s = _append(rows[2], X2.view(B, H, 1, -1), hot)
    EG2s = _append(rows[3], (e * G2).view(B, H, 1, -1), hot)
    z1 = _read(qr, Z1q, X1s, EG1s, b1 is not None, _prior(carry, 0), t)
    x2 = F.gelu(z1, approximate="tanh")
    z2 = torch.baddbmm(b2r, x2, W2r) if b2 is not None else torch.bmm(x2, W2r)
    z2 = _read(x2, z2, X2s, EG2s, b2 is not None, _prior(carry, 1), t)
    return _out(z2, q, norm, residual, B, H), _commit(carry, (X1s, EG1s, X2s, EG2s), tau, b)


def minibatch_rows(kind: str, start: Weights, k: torch.Tensor, v: torch.Tensor,
                   eta: torch.Tensor, norm: Any, residual: bool) -> Rows:
    """The rows (X, EG per inner layer, [B, H, n, D]) of n tokens of one mini-batch whose start
    weights are ``start``: every token's inputs and eta * dl/d(output), all at ``start`` (what
    ``n`` decoding steps from the mini-batch's start would carry). k [B, n, H, Dk],
    v [B, n, H, Dv], eta [B, n, H], norm from ``step._norm``; compute dtype throughout."""
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


@float32_compute
def layer_state_after(
    kind: str, op_state: tuple[Any, ...], state_in: Any, k: torch.Tensor, v: torch.Tensor,
    eta: torch.Tensor, *, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None,
    residual: bool, mini_batch_size: int,
) -> DecodeCarry:
    """The TTT layers' state after a multi-token call, as a DecodeCarry: what decoding the
    call's tokens one at a time would carry. ``op_state``: the op's final state for the call's
    tokens k, v, eta ([B, T, H, D], [B, T, H], the op's inputs); ``state_in``: the state the call
    started from (None, an op state, the initial weights or a DecodeCarry). The op's sums are
    replaced by the rows of the current mini-batch's tokens, computed at its start weights; a
    mini-batch that began before the call keeps ``state_in``'s rows (or its sums as ``prior``)."""
    n = 2 if kind == "linear" else 4
    if len(op_state) == n:  # the call ended on a mini-batch boundary
        return DecodeCarry(tuple(op_state), None, _empty_rows(op_state, n // 2, 0), 0, 0)
    start, pos, T = tuple(op_state[n:2 * n]), op_state[-1], k.shape[1]
    cdtype = start[0].dtype

    def cast(x: torch.Tensor | None) -> torch.Tensor | None:
        return to_dtype(x, cdtype)

    m = min(pos, T)  # this call's tokens in the current mini-batch
    rows = minibatch_rows(kind, start, cast(k[:, T - m:]), cast(v[:, T - m:]),
                          cast(eta[:, T - m:]), _norm(cast(ln_weight), cast(ln_bias)), residual)
    if m == pos:
        return DecodeCarry(start, None, rows, pos, 0)
    # The mini-batch began before the call: its earlier tokens are in state_in (its rows, or
    # the sums of an op state, which become the prior).
    before = decode_carry(state_in, kind, k.shape[0], k.shape[2], k.shape[-1], v.shape[-1],
                          mini_batch_size, k)
    rows = tuple(torch.cat([r0, r], dim=2) for r0, r in zip(before.rows, rows))
    steps = max(before.prior_steps - T, 0)
    return DecodeCarry(start, before.prior if steps else None, rows, pos, steps)


# The decoding step's Triton kernels (ops/ttt/triton_decode.py): one-token steps, taken by the
# automatic choice for one-token calls.
for _op in ("ttt_decode_linear", "ttt_decode_mlp"):
    register(_op, triton=Kernel(mode="step", chunk_name="mini_batch_size",
                                kernels=decode_kernels, one_token=True))


def _kernel_runs(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 eta: torch.Tensor, carry: DecodeCarry, backend: str | None,
                 options: dict[str, Any]) -> bool:
    """Whether this step runs in the decoding kernel (ops/ttt/triton_decode.py): the
    dispatcher's choice for the op "ttt_decode_<kind>" (CUDA, half-precision q, k, v, Dk <= 128,
    mini-batch <= 64), unless the kernel cannot take the step: head sizes the TTT kernels do
    not take (ops/ttt/kernels.py), per-row places, prior sums, weights not in float32, or
    gradients being recorded (it has no backward). Those stay on the PyTorch step; an explicit
    backend="triton" is then a ValueError saying why. ``options``: the step's other keyword
    arguments (state aside), for the automatic choice's trial step."""
    tensors = (q, k, v, eta, options["ln_weight"], options["ln_bias"], options["token_scale"],
               *carry.start, *carry.rows, *(carry.prior or ()))
    why = head_size_refusal(q.shape[-1], v.shape[-1])
    if why is not None:
        pass  # the head sizes say it
    elif isinstance(carry.pos, torch.Tensor):
        why = "a state with per-row places in the mini-batch (a long tensor pos)"
    elif carry.prior is not None:
        why = ("a state that continues an op state inside a mini-batch (its gradient sums, "
               "until that mini-batch completes)")
    elif carry.start[0].dtype != torch.float32:
        why = f"{carry.start[0].dtype} inner weights (the kernel keeps them in float32)"
    elif torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        why = ("the decoding kernel has no backward pass (gradients are being recorded); "
               "without gradients (torch.no_grad) it runs")

    def trial() -> Trial:
        def step(q, k, v, eta, *, backend, output_final_state, **kw):
            del output_final_state  # Trial asks every op for it; a step always returns it
            return ttt_decode_step(kind, q, k, v, eta, backend=backend, **kw)

        return Trial(step, (q, k, v, eta), state=carry, **options)

    return triton_chosen(f"ttt_decode_{kind}", q, backend, "step", options["mini_batch_size"],
                         why, trial)


@float32_compute
def ttt_decode_step(
    kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *,
    state: Any, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    mini_batch_size: int, token_scale: torch.Tensor | None,
    token_scale_values: Sequence[float] | None = None, backend: str | None = None,
) -> tuple[torch.Tensor, DecodeCarry]:
    """One decoding step of TTT-Linear (``kind`` "linear") or TTT-MLP ("mlp") for the layers.

    q, k: [B, 1, H, Dk]; v: [B, 1, H, Dv]; eta: [B, 1, H]; state: a DecodeCarry, an op state or
    the initial weights (as ``ttt_linear``'s ``initial_state``); other arguments as the ops'.
    Returns (o [B, 1, H, Dv] in q's dtype, DecodeCarry): the same output as the op's dual form,
    to rounding, computed in float32 (float64 stays float64).
    ``token_scale_values``: the entries of a 1-D ``token_scale`` as floats, which a caller
    decoding without gradients may pass (the TTT layers keep them): tau_i then scales the
    products as a number instead of a tensor (ignored with gradients recorded, while tracing,
    and for per-row places).
    backend: "triton" (the fused step of ops/ttt/triton_decode.py: CUDA, float16 or
    bfloat16 q, k, v, head sizes multiples of 16 up to 128, mini_batch_size <= 64, one place
    for every row and no op state's gradient sums, no gradients recorded), "torch", or None
    (the automatic choice: the kernel where it can run the step). An explicit choice that
    cannot run the step is a ValueError saying why.
    The caller (a TTT layer) has checked the shapes; an op state is checked by ``Carry.check``.
    """
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    if T != 1:
        raise ValueError(f"ttt_decode_step takes one token (q of shape [B, 1, H, D]), got T={T}")
    b = mini_batch_size
    carry = decode_carry(state, kind, B, H, Dk, Dv, b, q)
    options = {"ln_weight": ln_weight, "ln_bias": ln_bias, "residual": residual,
               "mini_batch_size": b, "token_scale": token_scale}
    if _kernel_runs(kind, q, k, v, eta, carry, backend, options):
        tau = q.new_ones(b, dtype=torch.float32) if token_scale is None else token_scale
        kernels = decode_kernels()
        run = kernels.ttt_linear_decode_triton if kind == "linear" else \
            kernels.ttt_mlp_decode_triton
        o, committed, rows = run(q, k, v, eta, carry, ln_weight, ln_bias, residual, tau)
        if committed is not None:  # the token completed the mini-batch
            return o, DecodeCarry(committed, None, _empty_rows(committed, len(committed) // 2, 0),
                                  0, 0)
        return o, DecodeCarry(carry.start, None, rows, carry.pos + 1, 0)
    cdtype = state_dtype(q.dtype)

    def cast(x: torch.Tensor | None) -> torch.Tensor | None:
        return to_dtype(x, cdtype)

    tau = q.new_ones(b, dtype=cdtype) if token_scale is None else cast(token_scale)
    values = token_scale_values
    if values is not None and (tau.dim() != 1 or len(values) != b or torch.is_grad_enabled()
                               or torch.compiler.is_compiling()):
        values = None
    step = _linear_step if kind == "linear" else _mlp_step
    o, carry = step(cast(q), cast(k), cast(v), cast(eta), carry,
                    _group_norm(cast(ln_weight), cast(ln_bias)), residual, tau, values)
    return (o if o.dtype == q.dtype else o.to(q.dtype)), carry


__all__ = ["DecodeCarry", "decode_carry", "layer_state_after", "minibatch_rows",
           "stack_decode_carries", "to_op_state", "ttt_decode_step"]
