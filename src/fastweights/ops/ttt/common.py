"""Pieces shared by the TTT forms (docs/maths.md 2.2-2.4): the inner LayerNorm and the gradient of
the inner loss through it, GELU (tanh) and its derivative, the mini-batch layout and the carried
state.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, Dh = 4 Dk (MLP hidden),
b mini-batch size, N number of mini-batches in a call, p tokens of the first mini-batch that an
earlier call already consumed. Internal mini-batch layout: ``[B, H, N, b, D]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..._checks import check_arg, check_tensor, is_int, state_dtype

LN_EPS = 1e-6
_GELU_C = math.sqrt(2.0 / math.pi)

Weights = tuple[torch.Tensor | None, ...]  # (W, b) or (W1, b1, W2, b2), [B, H, ...]; None = no bias


Rows = tuple[torch.Tensor, ...]  # (X, EG) per inner layer, [B, H, r, Din], [B, H, r, Dout]


class TTTState(NamedTuple):
    """The state of ``ttt_linear`` / ``ttt_mlp`` inside a mini-batch (docs/design.md, "State
    layouts"): what the tokens of the open mini-batch left, in the form one-token decoding
    carries them (docs/maths.md 2.4's dual form, one row at a time).

    start: the inner weights at the start of the open mini-batch, [B, H, ...] (biases None
        when the inner model has none).
    rows: (X, EG) per inner layer (TTT-Linear one pair, TTT-MLP two): the inputs
        [B, H, r, Din] and eta * dl/d(output) [B, H, r, Dout] of the open mini-batch's tokens,
        every gradient taken at ``start``.
    pos: tokens of the open mini-batch, an int in [1, b) with r = pos rows; or a long tensor
        [B] of per-row places in [0, b) (rows at their own places: streams decoded together),
        the rows then b-row buffers, zero beyond each row's place.

    The weights after the last token are start - tau_pos sum_j x_j^T eg_j (``weights``). At a
    mini-batch boundary the state is the weights themselves, a plain tuple."""

    start: Weights
    rows: Rows
    pos: int | torch.Tensor

    def sums(self) -> Weights:
        """The gradient sums S = sum_j eta_j grad_j of the open mini-batch: X^T EG per matrix,
        EG summed over the rows per bias."""
        out: list[torch.Tensor | None] = []
        for i, w in enumerate(self.start):
            X, EG = self.rows[i // 2 * 2], self.rows[i // 2 * 2 + 1]
            out.append(None if w is None else EG.sum(2) if i % 2 else X.transpose(-1, -2) @ EG)
        return tuple(out)

    def weights(self, token_scale: torch.Tensor | None = None) -> Weights:
        """The inner weights after the last token, start - tau_pos S (tau ``token_scale``,
        [b] or [H, b], the op's; None: ones)."""
        sums = self.sums()
        if token_scale is None:
            return tuple(None if w is None else w - g for w, g in zip(self.start, sums))
        tau = token_scale.to(self.start[0].dtype)
        tau = tau if tau.dim() == 2 else tau.expand(self.start[0].shape[1], -1)
        return current_weights(Carry(self.start, sums, self.pos), tau)

    @classmethod
    def check(cls, state: Any, kind: str, B: int, H: int, Dk: int, Dv: int, b: int,
              q: torch.Tensor, name: str = "initial_state") -> TTTState:
        """A carried state (``kind`` "linear" or "mlp") for q [B, T, H, Dk] and mini-batches of
        b tokens, its tensors [B, H, ...] in the compute dtype (a batch of 1 broadcasts)."""
        start, rows, pos = state
        pos = _check_pos(pos, f"{name}.pos", B, b, q)
        n = len(weight_specs(kind, Dk, Dv))
        if not isinstance(start, (tuple, list)) or len(start) != n:
            raise TypeError(f"{name}.start must be the {n} start weights, got "
                            f"{type(start).__name__}")
        start = _checked_weights(start, kind, B, H, Dk, Dv, q, f"{name}.start")
        r = b if isinstance(pos, torch.Tensor) else pos
        widths = [d for w in start[::2] for d in (w.shape[-2], w.shape[-1])]
        if not isinstance(rows, (tuple, list)) or len(rows) != len(widths):
            raise TypeError(f"{name}.rows must be {len(widths)} tensors (inputs and output "
                            f"gradients of each inner layer), got {type(rows).__name__}")
        cdtype = state_dtype(q.dtype)
        checked = []
        for i, (x, d) in enumerate(zip(rows, widths)):
            x = check_arg(f"{name}.rows[{i}]", x, (None, H, r, d), f"[B or 1, H, {r}, {d}]", q)
            if x.shape[0] not in (1, B):
                raise ValueError(f"{name}.rows[{i}] must have batch size 1 or B={B}, got shape "
                                 f"{tuple(x.shape)}")
            checked.append(to_dtype(x, cdtype).expand(B, *x.shape[1:]))
        return cls(start, tuple(checked), pos)

    @staticmethod
    def stack(states: Sequence[Any], b: int) -> TTTState:
        """One state for a batch whose row i continues ``states[i]`` (TTT states of one kind:
        weights at a boundary or ``TTTState``, batch B_i each) at its own place: pos a long
        tensor [sum B_i], rows b-row buffers (zero beyond each place)."""
        starts, rows, places = [], [], []
        for state in states:
            if isinstance(state, TTTState):
                starts.append(tuple(state.start))
                rows.append(tuple(r if not isinstance(state.pos, int) else
                                  F.pad(r, (0, 0, 0, b - r.shape[2])) for r in state.rows))
                p = state.pos
            else:
                starts.append(tuple(state))
                rows.append(empty_rows(tuple(state), b))
                p = 0
            n = starts[-1][0].shape[0]
            device = starts[-1][0].device
            places.append(torch.as_tensor(p, device=device, dtype=torch.long).reshape(-1).expand(n))
        if len({len(s) for s in starts}) != 1:
            raise ValueError("states must be TTT states of one kind (TTT-Linear or TTT-MLP)")

        def cat(items: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if items[0] is None else torch.cat(items)

        return TTTState(tuple(cat([s[i] for s in starts]) for i in range(len(starts[0]))),
                        tuple(cat([r[i] for r in rows]) for i in range(len(rows[0]))),
                        torch.cat(places))


def empty_rows(start: Weights, r: int = 0) -> Rows:
    """Zero rows [B, H, r, D] for every inner layer's inputs and output gradients."""
    rows: list[torch.Tensor] = []
    for w in start[::2]:
        B, H, Din, Dout = w.shape
        rows += [w.new_zeros(B, H, r, Din), w.new_zeros(B, H, r, Dout)]
    return tuple(rows)


class Carry(NamedTuple):
    """The inner learner's state between calls in the form the parallel forms and the kernels
    use: the sums of the open mini-batch rather than its rows (the dual form converts a
    ``TTTState`` to it once, at entry).

    start: inner weights at the start of the current mini-batch (after the last full one).
    grads: sum over the current mini-batch so far of eta_j * grad_j (all taken at ``start``);
        None when ``pos`` is 0.
    pos: tokens of the current mini-batch already consumed, 0 <= pos < b: one int for every row,
        or a long tensor [B] with each row's own count (rows decoded together from different
        places, one token per call); ``grads`` is then always given, zero in rows at place 0.
    The weights after the last token are ``start - tau_pos * grads`` (docs/maths.md 2.3).
    """

    start: Weights
    grads: Weights | None
    pos: int | torch.Tensor

    @classmethod
    def check(cls, initial_state: Any, kind: str, B: int, H: int, Dk: int, Dv: int,
              mini_batch_size: int, q: torch.Tensor) -> Carry:
        """Check ``initial_state`` (the weights, or a ``TTTState``) and return it as a Carry of
        [B, H, ...] tensors (a batch dim of 1 is broadcast) in the compute dtype."""
        state = check_state(initial_state, kind, B, H, Dk, Dv, mini_batch_size, q)
        if isinstance(state, TTTState):
            return cls(state.start, state.sums(), state.pos)
        return cls(state, None, 0)


def check_state(state: Any, kind: str, B: int, H: int, Dk: int, Dv: int, b: int,
                q: torch.Tensor, name: str = "initial_state") -> Weights | TTTState:
    """A TTT op's state: the inner weights (W, b) / (W1, b1, W2, b2) (biases may be None,
    a leading batch dim of 1 broadcasts) or a ``TTTState``, checked, in the compute dtype."""
    specs = weight_specs(kind, Dk, Dv)
    n = len(specs)
    names = ", ".join(name_ for name_, _, _ in specs)
    if state is None:
        raise ValueError(
            f"{name} is required: the inner model's starting weights ({names}), "
            "biases may be None; a leading batch dim of 1 broadcasts"
        )
    if isinstance(state, TTTState) or (isinstance(state, (tuple, list)) and len(state) == 3
                                       and isinstance(state[0], (tuple, list))):
        return TTTState.check(state, kind, B, H, Dk, Dv, b, q, name)
    if not isinstance(state, (tuple, list)) or len(state) != n:
        got = (f"a {type(state).__name__} of length {len(state)}"
               if isinstance(state, (tuple, list)) else type(state).__name__)
        raise TypeError(
            f"{name} must be a tuple ({names}) or a TTTState an earlier call returned "
            f"(inside a mini-batch: start weights, rows, pos), got {got}"
        )
    return _checked_weights(state, kind, B, H, Dk, Dv, q, name)


def _checked_weights(state: Sequence[Any], kind: str, B: int, H: int, Dk: int, Dv: int,
                     q: torch.Tensor, name: str) -> Weights:
    """The n inner weights of ``state``, checked, [B, H, ...] in the compute dtype."""
    specs = weight_specs(kind, Dk, Dv)
    cdtype = state_dtype(q.dtype)
    plain = _plain_items(state, specs, B, H, cdtype, q.device)
    if plain is not None:
        return plain
    items = []
    for i, x in enumerate(state):
        label_, shape, layout = specs[i]
        label = f"{name}[{i}] ({label_})"
        is_bias = i % 2 == 1
        if x is None:
            if not is_bias:
                raise ValueError(f"{label} must be a tensor {layout}, got None")
            items.append(None)
            continue
        check_tensor(label, x)
        check_arg(label, x, (None, H, *shape), layout.replace("B or 1", "*"), q)
        if x.shape[0] not in (1, B):
            raise ValueError(f"{label} must have batch size 1 or B={B}, got shape {tuple(x.shape)}")
        items.append(to_dtype(x, cdtype).expand(B, *x.shape[1:]))
    return tuple(items)


def _plain_items(state: Sequence[Any], specs: list[tuple[str, tuple[int, ...], str]],
                 B: int, H: int, dtype: torch.dtype, device: torch.device) -> Weights | None:
    """The weights of ``state`` as they are, when every one is already what the check would
    make of it: a tensor [B, H, ...] of ``dtype`` on ``device`` (biases may be None). None
    otherwise, and the item-by-item check then explains what is wrong or casts. This is the
    path of every state the ops return, checked in a few attribute reads per item (a decoding
    step's budget)."""
    items = tuple(state)
    for i, x in enumerate(items):
        if x is None:
            if i % 2 == 0:
                return None
        elif not (isinstance(x, torch.Tensor) and x.dtype == dtype and x.device == device
                  and x.shape[0] == B and x.shape[1] == H and x.shape[2:] == specs[i][1]):
            return None
    return items


def _check_pos(pos: Any, what: str, B: int, b: int, q: torch.Tensor) -> int | torch.Tensor:
    """The place in the mini-batch of a mid-mini-batch state: an int in [1, b), or a long tensor
    [B] of per-row places in [0, b) on q's device (its values are not read: a check would read
    them back to the host, which a decoding step does not)."""
    if isinstance(pos, torch.Tensor):
        if pos.dtype != torch.long or pos.shape != (B,) or pos.device != q.device:
            raise ValueError(f"{what} given per row must be a long tensor [B] = [{B}] on "
                             f"{q.device}, got {pos.dtype} {tuple(pos.shape)} on {pos.device}")
        return pos
    if not is_int(pos) or not 1 <= pos < b:
        raise ValueError(f"{what} must be an int in [1, mini_batch_size={b}) or a long tensor "
                         f"[B] of per-row places in [0, {b}), got {pos!r}")
    return pos


def weight_specs(kind: str, Dk: int, Dv: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, per-head shape, layout) of each inner weight of ``kind`` ("linear" or "mlp"), in
    the state's order; odd positions are the biases."""
    if kind == "linear":
        return [("W", (Dk, Dv), "[B or 1, H, Dk, Dv]"), ("b", (Dv,), "[B or 1, H, Dv]")]
    Dh = 4 * Dk
    return [
        ("W1", (Dk, Dh), "[B or 1, H, Dk, 4*Dk]"), ("b1", (Dh,), "[B or 1, H, 4*Dk]"),
        ("W2", (Dh, Dv), "[B or 1, H, 4*Dk, Dv]"), ("b2", (Dv,), "[B or 1, H, Dv]"),
    ]


def to_dtype(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """x in ``dtype`` (None stays None). No ``.to()`` where x already has it: that saves a
    dispatch per tensor, and a decoding step is a chain of small operations where each counts."""
    return x if x is None or x.dtype == dtype else x.to(dtype)


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


def fused_ln_loss_grad(z: torch.Tensor, target: torch.Tensor, gamma: torch.Tensor,
                       beta: torch.Tensor | None) -> torch.Tensor:
    """``loss_grad`` with LayerNorm in two fused ATen calls: g = gamma * (LN(Z) - target) taken
    back through the normalisation is exactly ``native_layer_norm_backward`` of g without an
    affine part. gamma, beta broadcast against z [..., Dv]. Differentiable once, not twice
    (torch's derivative of native_layer_norm_backward fails gradgradcheck)."""
    d = z.shape[-1:]
    x_hat, mean, rstd = torch.native_layer_norm(z, d, None, None, LN_EPS)
    y = x_hat * gamma if beta is None else torch.addcmul(beta, x_hat, gamma)
    return torch.ops.aten.native_layer_norm_backward(
        (y - target) * gamma, z, d, mean, rstd, None, None, [True, False, False])[0]


def loss_grad(
    z: torch.Tensor, target: torch.Tensor, ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None,
) -> torch.Tensor:
    """dl/dZ of l = 1/2 ||[LN](Z) - target||^2 for every row of z [B, H, ..., Dv]
    (docs/maths.md 2.2).

    With LayerNorm: x_hat = (Z - mu) / s, s = sqrt(var + eps), g = gamma * (LN(Z) - target),
    dl/dZ = (Dv g - sum g - x_hat sum(g x_hat)) / (Dv s). Without: Z - target.
    """
    if ln_weight is None:
        return z - target
    d = z.shape[-1]
    if not (torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (z, target, ln_weight, ln_bias))):
        # No autograd (inference): ATen's fused LayerNorm kernels, two calls instead of ~14
        # small ops per mini-batch step. Not under autograd: the expression below is twice
        # differentiable, the fused form only once.
        beta = None if ln_bias is None else per_head(ln_bias, z)
        return fused_ln_loss_grad(z, target, per_head(ln_weight, z), beta)
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
    """GELU, tanh approximation (docs/maths.md 2.2)."""
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
    # [B, H, T, ...], contiguous before the pad: F.pad with nothing to add returns its input's
    # strides in eager mode but contiguous ones in a traced graph, whose reshape then becomes a
    # view that fails at run time (torch.compile(dynamic=True), T a multiple of b).
    x = x.movedim(1, 2).contiguous()
    pad = [0, 0] * (x.dim() - 3) + [p, N * b - p - T]
    return F.pad(x, pad).reshape(B, H, N, b, *x.shape[3:])


def _blocks(x: torch.Tensor, p: int, b: int) -> torch.Tensor:
    """[B, T, H, *rest] -> [B, N, b, H, *rest]: p zero rows in front (the part of the first
    mini-batch an earlier call consumed), zero rows at the tail up to N*b; a view of x when
    nothing needs padding."""
    T = x.shape[1]
    N = -(-(p + T) // b)
    if p or N * b != p + T:
        x = F.pad(x, [0, 0] * (x.dim() - 2) + [p, N * b - p - T])
    return x.unflatten(1, (N, b))


def _step_major(x: torch.Tensor, p: int, b: int) -> torch.Tensor:
    """[B, T, H, *rest] -> [N, B, H, b, *rest] (``_blocks`` permuted), a view where it can be."""
    x = _blocks(x, p, b)
    return x.permute(1, 0, 3, 2, *range(4, x.dim()))


def to_steps(x: torch.Tensor, p: int, b: int, ones: bool = False) -> torch.Tensor:
    """[B, T, H, *rest] -> [N, B*H, b, *rest], step-major and contiguous (mini-batch n of every
    sequence and head is one contiguous block), with the padding of ``to_minibatches``;
    ``ones`` appends a column of ones (a bias's input) to the last dim. One copy, two when T
    needs padding."""
    x = _step_major(x, p, b)
    x = F.pad(x, (0, 1), value=1.0) if ones else x.contiguous()
    return x.flatten(1, 2)


def kq_steps(k: torch.Tensor, q: torch.Tensor, p: int, b: int, ones: bool) -> torch.Tensor:
    """Keys and queries [B, T, H, Dk] -> one step-major buffer [N, B*H, 2b, Dk(+1)]: mini-batch
    n's keys in rows 0..b-1 and its queries in rows b..2b-1 (``to_steps`` of each, with the
    bias's column of ones when ``ones``). Without autograd both are written straight into one
    allocation (each fresh large buffer costs first-touch page faults, which do not get faster
    with more threads); with it, by one stack whose backward pass is views (in-place writes
    into slices would copy the whole gradient once per write)."""
    B, T, H, Dk = k.shape
    N = -(-(p + T) // b)
    if torch.is_grad_enabled() and (k.requires_grad or q.requires_grad):
        buf = torch.stack([_step_major(k, p, b), _step_major(q, p, b)], dim=3)  # [N, B, H, 2, b, Dk]
        buf = F.pad(buf, (0, 1), value=1.0) if ones else buf
        return buf.reshape(N, B * H, 2 * b, Dk + ones)
    buf = k.new_empty(N, B, H, 2, b, Dk + ones)
    buf[:, :, :, 0, :, :Dk].copy_(_step_major(k, p, b))
    buf[:, :, :, 1, :, :Dk].copy_(_step_major(q, p, b))
    if ones:
        buf[..., Dk] = 1.0
    return buf.view(N, B * H, 2 * b, Dk + ones)


def steps_to_output(Zbar: torch.Tensor, q: torch.Tensor, p: int, T: int, H: int,
                    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None,
                    residual: bool) -> torch.Tensor:
    """The dual forms' read-out from step-major Zbar [N, B*H, b, Dv]: [LN](Zbar) (+ q with
    ``residual``) as o [B, T, H, Dv], laid out like q, the per-head affine part and the
    residual applied in the output layout (one pass each)."""
    N, BH, b, Dv = Zbar.shape
    B = BH // H
    if ln_weight is not None:  # the affine part is applied per head in the output layout
        Zbar = F.layer_norm(Zbar, (Dv,), eps=LN_EPS)
    out = Zbar.unflatten(1, (B, H)).permute(1, 0, 3, 2, 4)  # [B, N, b, H, Dv], a view
    if residual:
        qp = _blocks(q, p, b)  # [B, N, b, H, Dv]
        # q first: the result is laid out like q (contiguous), so the reshape below is a view
        out = qp + out if ln_weight is None else torch.addcmul(qp, out, ln_weight)
    elif ln_weight is not None:
        out = out * ln_weight
    if ln_bias is not None:  # out is a fresh tensor here (ln_bias comes with ln_weight)
        out.add_(ln_bias)
    return out.reshape(B, N * b, H, Dv)[:, p:p + T]


def from_minibatches(x: torch.Tensor, p: int, T: int) -> torch.Tensor:
    """[B, H, N, b, D] -> [B, T, H, D], dropping the padding rows."""
    B, H, N, b, D = x.shape
    return x.reshape(B, H, N * b, D)[:, :, p:p + T].transpose(1, 2)


def current_weights(carry: Carry, tau: torch.Tensor) -> Weights:
    """Weights after the last consumed token: start - tau_pos * grads (docs/maths.md 2.3); tau
    [H, b]."""
    if isinstance(carry.pos, int):
        if carry.pos == 0:
            return carry.start
        t = tau[:, carry.pos - 1]  # [H]
        return tuple(
            None if w is None else w - per_head(t, w) * g for w, g in zip(carry.start, carry.grads)
        )
    # Per row: rows at place 0 have zero sums, so any tau gives their start weights.
    t = tau.t()[carry.pos - 1]  # [B, H]
    return tuple(None if w is None else w - t.view(*t.shape, *[1] * (w.dim() - 2)) * g
                 for w, g in zip(carry.start, carry.grads))
