"""Pieces shared by the TTT forms (SPEC.md 2.2-2.4): the inner LayerNorm and the gradient of the
inner loss through it, GELU (tanh) and its derivative, the mini-batch layout and the carried state.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, Dh = 4 Dk (MLP hidden),
b mini-batch size, N number of mini-batches in a call, p tokens of the first mini-batch that an
earlier call already consumed. Internal mini-batch layout: ``[B, H, N, b, D]``.
"""

from __future__ import annotations

import math
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
    pos: tokens of the current mini-batch already consumed, 0 <= pos < b.
    The weights after the last token are ``start - tau_pos * grads`` (SPEC 2.3).
    """

    start: Weights
    grads: Weights | None
    pos: int

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
        pos = initial_state[-1]
        if not is_int(pos) or not 1 <= pos < mini_batch_size:
            raise ValueError(
                f"initial_state[{3 * n}] (position in the mini-batch) must be an int in "
                f"[1, mini_batch_size={mini_batch_size}), got {pos!r}"
            )
        return cls(tuple(items[n:2 * n]), tuple(items[2 * n:]), pos)

    def final_state(self, tau: torch.Tensor, current: Weights | None = None) -> tuple[Any, ...]:
        """The public state after the call: the weights, and when the call ended inside a
        mini-batch also (*start weights, *gradient sums, pos) (see ``ttt_linear``).
        ``current``: the current weights, where the caller already has them (else computed)."""
        if self.pos == 0:
            return self.start
        if current is None:
            current = current_weights(self, tau)
        return (*current, *self.start, *self.grads, self.pos)


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


def loss_grad(
    z: torch.Tensor, target: torch.Tensor, ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None,
) -> torch.Tensor:
    """dl/dZ of l = 1/2 ||[LN](Z) - target||^2 for every row of z [B, H, ..., Dv] (SPEC 2.2).

    With LayerNorm: x_hat = (Z - mu) / s, s = sqrt(var + eps), g = gamma * (LN(Z) - target),
    dl/dZ = (Dv g - sum g - x_hat sum(g x_hat)) / (Dv s). Without: Z - target.
    """
    if ln_weight is None:
        return z - target
    d = z.shape[-1]
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
    """GELU, tanh approximation (SPEC 2.2)."""
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


def from_minibatches(x: torch.Tensor, p: int, T: int) -> torch.Tensor:
    """[B, H, N, b, D] -> [B, T, H, D], dropping the padding rows."""
    B, H, N, b, D = x.shape
    return x.reshape(B, H, N * b, D)[:, :, p:p + T].transpose(1, 2)


def current_weights(carry: Carry, tau: torch.Tensor) -> Weights:
    """Weights after the last consumed token: start - tau_pos * grads (SPEC 2.3); tau [H, b]."""
    if carry.pos == 0:
        return carry.start
    t = tau[:, carry.pos - 1]  # [H]
    return tuple(
        None if w is None else w - per_head(t, w) * g for w, g in zip(carry.start, carry.grads)
    )
