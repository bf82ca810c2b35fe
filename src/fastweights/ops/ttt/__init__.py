"""Test-time training layers' inner loop: TTT-Linear and TTT-MLP (SPEC.md 2, Sun et al. 2024).

A per-head inner model f(z) = [z +] [LN](f_res(z)) is trained on the sequence itself with the
loss l_t = 1/2 ||[LN](f_res(k_t)) - target_t||^2 (target = v - k with the residual, else v, SPEC
2.2) by mini-batch gradient descent: within a mini-batch every gradient is taken at the start
weights, W_i = W_0 - tau_i sum_{j<=i} eta_j grad l_j(W_0), and the output is read with the weights
after the token's own update: o_t = [q_t +] [LN](f_res(q_t; W_t)).

Three forms that agree: ``"dual"`` (default, dual.py, SPEC 2.4), ``"primal"`` (primal.py,
per-token weights) and ``"naive"`` (naive.py, token loop with autograd gradients, the oracle).
The public functions validate every argument first, compute in float32 (float64 stays float64),
and return outputs in the input dtype with float32-or-wider states.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..._checks import (
    check_bool,
    check_mode,
    check_positive_int,
    check_qkv,
    check_shape,
    check_tensor,
    state_dtype,
)
from .._autocast import float32_compute
from .._varlen import check_cu_seqlens, run_packed
from .common import Carry, current_weights
from .dual import ttt_linear_dual, ttt_mlp_dual
from .naive import linear_f_res, mlp_f_res, ttt_naive
from .primal import ttt_linear_primal, ttt_mlp_primal

__all__ = ["ttt_linear", "ttt_mlp"]

MODES = ("dual", "primal", "naive")
TTTState = tuple[Any, ...]

_KERNELS = {
    "linear": {
        "dual": ttt_linear_dual, "primal": ttt_linear_primal,
        "naive": lambda *a: ttt_naive(linear_f_res, *a),
    },
    "mlp": {
        "dual": ttt_mlp_dual, "primal": ttt_mlp_primal,
        "naive": lambda *a: ttt_naive(mlp_f_res, *a),
    },
}


def _weight_specs(kind: str, Dk: int, Dv: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, per-head shape, layout) of each inner weight; odd positions are the biases."""
    if kind == "linear":
        return [("W", (Dk, Dv), "[B or 1, H, Dk, Dv]"), ("b", (Dv,), "[B or 1, H, Dv]")]
    Dh = 4 * Dk
    return [
        ("W1", (Dk, Dh), "[B or 1, H, Dk, 4*Dk]"), ("b1", (Dh,), "[B or 1, H, 4*Dk]"),
        ("W2", (Dh, Dv), "[B or 1, H, 4*Dk, Dv]"), ("b2", (Dv,), "[B or 1, H, Dv]"),
    ]


def _parse_state(
    initial_state: Any, kind: str, B: int, H: int, Dk: int, Dv: int, mini_batch_size: int,
    ref: torch.Tensor,
) -> Carry:
    """Check initial_state = (*weights) or (*weights, *start weights, *gradient sums, pos) and
    return it as a Carry of [B, H, ...] tensors (a batch dim of 1 is broadcast) in the compute
    dtype. The leading (current) weights of a mid-mini-batch state are implied by the rest."""
    specs = _weight_specs(kind, Dk, Dv)
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
        check_shape(label, x, (None, H, *shape), layout.replace("B or 1", "*"))
        if x.shape[0] not in (1, B):
            raise ValueError(f"{label} must have batch size 1 or B={B}, got shape {tuple(x.shape)}")
        if x.device != ref.device:
            raise ValueError(f"{label} is on device {x.device} but q is on {ref.device}; they must match")
        if is_bias and initial_state[i % n] is None:
            raise ValueError(f"{label} is a tensor but the bias initial_state[{i % n}] is None")
        items.append(x.to(state_dtype(ref.dtype)).expand(B, *x.shape[1:]))
    if len(initial_state) == n:
        return Carry(tuple(items), None, 0)
    pos = initial_state[-1]
    if isinstance(pos, bool) or not isinstance(pos, int) or not 1 <= pos < mini_batch_size:
        raise ValueError(
            f"initial_state[{3 * n}] (position in the mini-batch) must be an int in "
            f"[1, mini_batch_size={mini_batch_size}), got {pos!r}"
        )
    return Carry(tuple(items[n:2 * n]), tuple(items[2 * n:]), pos)


def _check_per_head(name: str, x: Any, H: int, Dv: int, ref: torch.Tensor) -> None:
    check_tensor(name, x)
    check_shape(name, x, (H, Dv), "[H, Dv]")
    if x.device != ref.device:
        raise ValueError(f"{name} is on device {x.device} but q is on {ref.device}; they must match")


def _ttt(
    kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor,
    initial_state: Sequence[Any], ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None,
    residual: bool, mini_batch_size: int, token_scale: torch.Tensor | None,
    output_final_state: bool, mode: str, cu_seqlens: torch.Tensor | None = None,
    checkpoint_group: int | None = None,
) -> tuple[torch.Tensor, TTTState | None]:
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    if checkpoint_group is not None:
        check_positive_int("checkpoint_group", checkpoint_group)
    check_tensor("eta", eta)
    check_shape("eta", eta, (B, T, H), "[B, T, H]")
    if eta.device != q.device:
        raise ValueError(f"eta is on device {eta.device} but q is on {q.device}; they must match")
    check_mode(mode, MODES)
    b = check_positive_int("mini_batch_size", mini_batch_size)
    check_bool("residual", residual)
    check_bool("output_final_state", output_final_state)
    if residual and Dk != Dv:
        raise ValueError(
            f"residual=True adds q to the output and moves k into the target, so it needs "
            f"Dk == Dv; got Dk={Dk}, Dv={Dv}"
        )
    if ln_weight is not None:
        _check_per_head("ln_weight", ln_weight, H, Dv, q)
    if ln_bias is not None:
        if ln_weight is None:
            raise ValueError("ln_bias was given without ln_weight; ln_weight=None means no LayerNorm")
        _check_per_head("ln_bias", ln_bias, H, Dv, q)
    if token_scale is not None:
        check_tensor("token_scale", token_scale)
        if tuple(token_scale.shape) not in ((b,), (H, b)):
            raise ValueError(
                f"token_scale must have shape [mini_batch_size] = [{b}] or "
                f"[H, mini_batch_size] = [{H}, {b}], got {tuple(token_scale.shape)}"
            )
        if token_scale.device != q.device:
            raise ValueError(
                f"token_scale is on device {token_scale.device} but q is on {q.device}; they must match")
    if cu_seqlens is not None:
        n_docs = len(check_cu_seqlens(cu_seqlens, T, B, q.device)) - 1
        if not isinstance(initial_state, list):
            # One start state (the learned initial weights, batch 1) shared by every document.
            initial_state = [initial_state] * n_docs

        def one_document(q, k, v, eta, *, initial_state, output_final_state):
            return _ttt(kind, q, k, v, eta, initial_state, ln_weight, ln_bias, residual,
                        mini_batch_size, token_scale, output_final_state, mode,
                        checkpoint_group=checkpoint_group)

        return run_packed(one_document, (q, k, v, eta), cu_seqlens, initial_state,
                          output_final_state)
    carry = _parse_state(initial_state, kind, B, H, Dk, Dv, b, q)

    cdtype = state_dtype(q.dtype)
    if token_scale is None:
        tau = q.new_ones(H, b, dtype=cdtype)
    else:
        tau = token_scale.to(cdtype).expand(H, b)
    ln_w, ln_b = (None if x is None else x.to(cdtype) for x in (ln_weight, ln_bias))
    qc, kc, vc, etac = (x.to(cdtype) for x in (q, k, v, eta))
    extra = {"checkpoint_group": checkpoint_group} if mode == "dual" else {}
    o, carry = _KERNELS[kind][mode](qc, kc, vc, etac, carry, ln_w, ln_b, residual, tau, **extra)
    if not output_final_state:
        return o.to(q.dtype), None
    if carry.pos == 0:
        return o.to(q.dtype), carry.start
    return o.to(q.dtype), (*current_weights(carry, tau), *carry.start, *carry.grads, carry.pos)


@float32_compute
def ttt_linear(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *,
    initial_state: Sequence[Any], ln_weight: torch.Tensor | None = None,
    ln_bias: torch.Tensor | None = None, residual: bool = False, mini_batch_size: int = 16,
    token_scale: torch.Tensor | None = None, output_final_state: bool = False, mode: str = "dual",
    cu_seqlens: torch.Tensor | None = None, checkpoint_group: int | None = None,
) -> tuple[torch.Tensor, TTTState | None]:
    """TTT-Linear (SPEC 2.2-2.4): inner model f_res(z) = z W + b per head.

    q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; eta: [B, T, H] inner learning rates.
    initial_state (required): (W [B or 1, H, Dk, Dv], b [B or 1, H, Dv] or None for no bias), or
        a state returned by an earlier call. A batch dim of 1 broadcasts over B.
    ln_weight, ln_bias: [H, Dv] inner LayerNorm (eps 1e-6); ln_weight=None means no LayerNorm,
        ln_bias=None with a weight means a zero shift.
    residual: f(z) = z + ..., i.e. target v - k and output q + ... (needs Dk == Dv).
    mini_batch_size: b; gradients of a mini-batch are all taken at its start weights. T need not
        be a multiple of b: a last, shorter mini-batch uses tau_1.. again.
    token_scale: tau [b] (shared by the heads) or [H, b], the scale tau_i of the running gradient
        sum at position i of a mini-batch (E_ij = tau_i eta_j); None means ones (plain sums).
    mode: "dual" (default), "primal" or "naive"; they agree to rounding.
    Returns (o [B, T, H, Dv] in q's dtype, final state or None). The final state is (W, b) after
    the last token, in float32 (float64 for float64 inputs), with batch B. When the call ends
    inside a mini-batch (pos = (p + T) mod b != 0) it is (W, b, W_0, b_0, S_W, S_b, pos): the
    current weights W = W_0 - tau_pos S_W, the mini-batch's start weights, the sums
    S = sum_j eta_j grad_j(W_0) so far and the int pos; feeding it back continues the mini-batch
    exactly (its leading W, b are then ignored, being implied by the rest).
    cu_seqlens: [N + 1] boundaries of documents packed in a batch of one; each document starts
    from ``initial_state`` (one state shared by all, batch 1) or from its own entry of a list of
    N states, and the final state is a list with one state per document (ops/_varlen.py).
    checkpoint_group: dual mode, while gradients are recorded: run the mini-batch scan in groups
    of this many mini-batches, each recomputed in the backward pass instead of keeping every
    mini-batch's weights (SPEC 2.6: the paper uses 4); same results, less memory, one more
    forward of the scan. None (default) keeps everything.
    """
    return _ttt("linear", q, k, v, eta, initial_state, ln_weight, ln_bias, residual,
                mini_batch_size, token_scale, output_final_state, mode, cu_seqlens,
                checkpoint_group)


@float32_compute
def ttt_mlp(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *,
    initial_state: Sequence[Any], ln_weight: torch.Tensor | None = None,
    ln_bias: torch.Tensor | None = None, residual: bool = False, mini_batch_size: int = 16,
    token_scale: torch.Tensor | None = None, output_final_state: bool = False, mode: str = "dual",
    cu_seqlens: torch.Tensor | None = None, checkpoint_group: int | None = None,
) -> tuple[torch.Tensor, TTTState | None]:
    """TTT-MLP (SPEC 2.2-2.4): inner model f_res(z) = gelu_tanh(z W1 + b1) W2 + b2 per head,
    hidden size 4 Dk.

    initial_state (required): (W1 [B or 1, H, Dk, 4Dk], b1 [B or 1, H, 4Dk] or None,
    W2 [B or 1, H, 4Dk, Dv], b2 [B or 1, H, Dv] or None), or a state returned by an earlier call;
    mid-mini-batch states are (W1, b1, W2, b2, start W1, b1, W2, b2, sums W1, b1, W2, b2, pos).
    Every other argument, the output and the state semantics are as in ``ttt_linear``.
    """
    return _ttt("mlp", q, k, v, eta, initial_state, ln_weight, ln_bias, residual,
                mini_batch_size, token_scale, output_final_state, mode, cu_seqlens,
                checkpoint_group)
