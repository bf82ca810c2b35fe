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


class Carry(NamedTuple):
    """The inner learner's state between calls, in the form the kernels use.

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
        """Check ``initial_state`` = (*weights) or (*weights, *start weights, *gradient sums, pos)
        (``kind`` "linear" or "mlp") and return it as a Carry of [B, H, ...] tensors (a batch dim
        of 1 is broadcast) in the compute dtype. The leading (current) weights of a
        mid-mini-batch state are implied by the rest."""
        specs = weight_specs(kind, Dk, Dv)
        n = len(specs)
        names = ", ".join(name for name, _, _ in specs)
        if initial_state is None:
            raise ValueError(
                f"initial_state is required: the inner model's starting weights ({names}), "
                "biases may be None; a leading batch dim of 1 broadcasts"
            )
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) not in (n, 3 * n + 1):
            got = (f"a {type(initial_state).__name__} of length {len(initial_state)}"
                   if isinstance(initial_state, (tuple, list)) else type(initial_state).__name__)
            raise TypeError(
                f"initial_state must be a tuple ({names}) or a state returned by an earlier call "
                f"({3 * n + 1} items when it ends inside a mini-batch), got {got}"
            )
        plain = _plain_items(initial_state, specs, B, H, state_dtype(q.dtype), q.device)
        if plain is not None and len(initial_state) == n:
            return cls(plain, None, 0)
        if plain is not None:
            pos = _check_pos(initial_state[-1], 3 * n, B, mini_batch_size, q)
            return cls(plain[n:2 * n], plain[2 * n:], pos)
        groups = ["", "start ", "gradient-sum "]
        items = []
        for i, x in enumerate(initial_state[: (n if len(initial_state) == n else 3 * n)]):
            name, shape, layout = specs[i % n]
            label = f"initial_state[{i}] ({groups[i // n]}{name})"
            is_bias = i % 2 == 1
            if x is None:
                if not is_bias:
                    raise ValueError(f"{label} must be a tensor {layout}, got None")
                if initial_state[i % n] is not None:
                    raise ValueError(f"{label} is None but the bias initial_state[{i % n}] is not")
                items.append(None)
                continue
            check_tensor(label, x)
            check_arg(label, x, (None, H, *shape), layout.replace("B or 1", "*"), q)
            if x.shape[0] not in (1, B):
                raise ValueError(f"{label} must have batch size 1 or B={B}, got shape {tuple(x.shape)}")
            if is_bias and initial_state[i % n] is None:
                raise ValueError(f"{label} is a tensor but the bias initial_state[{i % n}] is None")
            items.append(x.to(state_dtype(q.dtype)).expand(B, *x.shape[1:]))
        if len(initial_state) == n:
            return cls(tuple(items), None, 0)
        pos = _check_pos(initial_state[-1], 3 * n, B, mini_batch_size, q)
        return cls(tuple(items[n:2 * n]), tuple(items[2 * n:]), pos)

    def final_state(self, tau: torch.Tensor, current: Weights | None = None) -> tuple[Any, ...]:
        """The public state after the call: the weights, and when the call ended inside a
        mini-batch also (*start weights, *gradient sums, pos) (see ``ttt_linear``); with
        per-row places always the latter, pos a long tensor [B].
        ``current``: the current weights, where the caller already has them (else computed)."""
        if isinstance(self.pos, int) and self.pos == 0:
            return self.start
        if current is None:
            current = current_weights(self, tau)
        return (*current, *self.start, *self.grads, self.pos)


def _plain_items(state: tuple[Any, ...] | list[Any], specs: list[tuple[str, tuple[int, ...], str]],
                 B: int, H: int, dtype: torch.dtype, device: torch.device) -> Weights | None:
    """The weight items of ``state`` (all 3n of a mid-mini-batch state, else n) as they are,
    when every one is already what ``Carry.check`` would make of it: a tensor [B, H, ...] of
    ``dtype`` on ``device``, biases None in every group or in none. None otherwise, and the
    item-by-item check then explains what is wrong or casts. This is the path of every state the
    ops return, checked in a few attribute reads per item (a decoding step's budget)."""
    n = len(specs)
    items = tuple(state[: n if len(state) == n else 3 * n])
    for i, x in enumerate(items):
        if x is None:
            if i % 2 == 0 or items[i % n] is not None:
                return None
        elif not (isinstance(x, torch.Tensor) and x.dtype == dtype and x.device == device
                  and x.shape[0] == B and x.shape[1] == H and x.shape[2:] == specs[i % n][1]
                  and (i % 2 == 0 or items[i % n] is not None)):
            return None
    return items


def _check_pos(pos: Any, index: int, B: int, b: int, q: torch.Tensor) -> int | torch.Tensor:
    """The place in the mini-batch of a mid-mini-batch state: an int in [1, b), or a long tensor
    [B] of per-row places in [0, b) on q's device."""
    what = f"initial_state[{index}] (position in the mini-batch)"
    if isinstance(pos, torch.Tensor):
        if pos.dtype != torch.long or pos.shape != (B,) or pos.device != q.device:
            raise ValueError(f"{what} given per row must be a long tensor [B] = [{B}] on "
                             f"{q.device}, got {pos.dtype} {tuple(pos.shape)} on {pos.device}")
        # A value check reads the tensor (a sync, and a data-dependent branch a traced program
        # cannot hold): eager calls only.
        if not torch.compiler.is_compiling() and bool(((pos < 0) | (pos >= b)).any()):
            raise ValueError(f"{what} per row must lie in [0, mini_batch_size={b}), got "
                             f"{pos.tolist()}")
        return pos
    if not is_int(pos) or not 1 <= pos < b:
        raise ValueError(f"{what} must be an int in [1, mini_batch_size={b}) or a long tensor "
                         f"[B] of per-row places in [0, {b}), got {pos!r}")
    return pos


def stack_inner_states(states: Sequence[Sequence[Any]], places: Sequence[torch.Tensor],
                       tau: torch.Tensor) -> tuple[Any, ...]:
    """One op state for a batch whose rows continue the given op states (``ttt_linear`` or
    ``ttt_mlp`` final states, batch B_i each), rows at their own places in their mini-batches:
    (*current, *start weights, *gradient sums, pos) with pos a long tensor [sum B_i] (from
    ``places``, [B_i] each: the states' places, 0 at a mini-batch boundary) and zero sums where
    a mini-batch is just starting; tau [b] or [H, b] gives the current weights."""
    if len(states) != len(places):
        raise ValueError(f"need one places tensor per state, got {len(places)} for {len(states)}")
    # (W, b) and (W1, b1, W2, b2) at a boundary; 7 and 13 items inside a mini-batch.
    kinds = {len(s) if len(s) in (2, 4) else (len(s) - 1) // 3 for s in states}
    n = kinds.pop()
    if kinds or any(len(s) not in (n, 3 * n + 1) for s in states) or n not in (2, 4):
        raise ValueError("states must be ttt_linear/ttt_mlp states of one kind: (*weights) or "
                         f"(*weights, *start, *sums, pos), got lengths {[len(s) for s in states]}")
    starts, sums = [], []
    for state in states:
        if len(state) == n:  # at a mini-batch boundary: the sums start from zero
            starts.append(tuple(state))
            sums.append(tuple(None if w is None else torch.zeros_like(w) for w in state))
        else:
            starts.append(tuple(state[n:2 * n]))
            sums.append(tuple(state[2 * n:3 * n]))
    start = tuple(None if w is None else torch.cat([s[i] for s in starts])
                  for i, w in enumerate(starts[0]))
    grads = tuple(None if w is None else torch.cat([s[i] for s in sums])
                  for i, w in enumerate(sums[0]))
    pos = torch.cat([p.to(device=start[0].device, dtype=torch.long) for p in places])
    tau = tau if tau.dim() == 2 else tau.expand(start[0].shape[1], -1)
    current = current_weights(Carry(start, grads, pos), tau.to(start[0].dtype))
    return (*current, *start, *grads, pos)


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
