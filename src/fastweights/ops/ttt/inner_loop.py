"""The public TTT ops ``ttt_linear`` and ``ttt_mlp`` (docs/maths.md 2.2-2.4): argument checks, the
``mode=`` switch over chunk.py (the dual form) / primal.py / naive.py, and the state in and out (``Carry``).

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, b mini-batch size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from ..._checks import (
    check_arg,
    check_bool,
    check_device,
    check_documents,
    check_mode,
    check_positive_int,
    check_qkv,
    check_tensor,
    state_dtype,
)
from .._autocast import float32_compute
from .._modes import TTT_MODES
from .._pieces import in_pieces, piece_length
from .._varlen import run_packed
from ..backend import Kernel, Trial, register
from .chunk import ttt_linear_dual, ttt_mlp_dual
from .common import Carry, to_dtype
from .kernels import head_size_refusal, triton_chosen, triton_kernels
from .naive import linear_f_res, mlp_f_res, ttt_naive
from .primal import ttt_linear_primal, ttt_mlp_primal
from .step import ttt_linear_step, ttt_mlp_step

MODES = TTT_MODES


TTTState = tuple[Any, ...]  # (*weights) or (*weights, *start weights, *gradient sums, pos)

# The forms, called with keywords (q, k, v, eta, carry, ln_weight, ln_bias, residual, tau).
_KERNELS = {
    "linear": {
        "dual": ttt_linear_dual, "primal": ttt_linear_primal,
        "naive": functools.partial(ttt_naive, linear_f_res),
    },
    "mlp": {
        "dual": ttt_mlp_dual, "primal": ttt_mlp_primal,
        "naive": functools.partial(ttt_naive, mlp_f_res),
    },
}


_STEPS = {"linear": ttt_linear_step, "mlp": ttt_mlp_step}
# The Triton kernels compute the dual form, a mini-batch per step (ops/ttt/triton.py); fla has none.
for _op in ("ttt_linear", "ttt_mlp"):
    register(_op, triton=Kernel(mode="dual", chunk_name="mini_batch_size",
                                kernels=triton_kernels))


def _ttt(
    kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *,
    initial_state: Sequence[Any], ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None,
    residual: bool, mini_batch_size: int, token_scale: torch.Tensor | None,
    output_final_state: bool, mode: str, cu_seqlens: torch.Tensor | None = None,
    checkpoint_group: int | None = None, backend: str | None = None,
) -> tuple[torch.Tensor, TTTState | None]:
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    if checkpoint_group is not None:
        check_positive_int("checkpoint_group", checkpoint_group)
    check_arg("eta", eta, (B, T, H), "[B, T, H]", q)
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
        check_arg("ln_weight", ln_weight, (H, Dv), "[H, Dv]", q)
    if ln_bias is not None:
        if ln_weight is None:
            raise ValueError("ln_bias was given without ln_weight; ln_weight=None means no LayerNorm")
        check_arg("ln_bias", ln_bias, (H, Dv), "[H, Dv]", q)
    if token_scale is not None:
        check_tensor("token_scale", token_scale)
        if tuple(token_scale.shape) not in ((b,), (H, b)):
            raise ValueError(
                f"token_scale must have shape [mini_batch_size] = [{b}] or "
                f"[H, mini_batch_size] = [{H}, {b}], got {tuple(token_scale.shape)}"
            )
        check_device("token_scale", token_scale, q)
    if cu_seqlens is not None:
        n_docs = check_documents(cu_seqlens, T, B, q.device).count
        if not isinstance(initial_state, list):
            # One start state (the learned initial weights, batch 1) shared by every document.
            initial_state = [initial_state] * n_docs

        def one_document(q, k, v, eta, *, initial_state, output_final_state):
            return _ttt(kind, q, k, v, eta, initial_state=initial_state, ln_weight=ln_weight,
                        ln_bias=ln_bias, residual=residual, mini_batch_size=mini_batch_size,
                        token_scale=token_scale, output_final_state=output_final_state,
                        mode=mode, checkpoint_group=checkpoint_group, backend=backend)

        return run_packed(one_document, (q, k, v, eta), cu_seqlens, initial_state,
                          output_final_state)
    carry = Carry.check(initial_state, kind, B, H, Dk, Dv, b, q)
    if isinstance(carry.pos, torch.Tensor) and (T != 1 or mode != "dual"):
        raise ValueError(
            "an initial_state with per-row places in the mini-batch (a long tensor pos) is "
            f"continued one token per call in mode='dual', got T={T}, mode={mode!r}; run rows "
            "at different places with more tokens as separate calls")

    cdtype = state_dtype(q.dtype)

    def cast(x: torch.Tensor | None) -> torch.Tensor | None:
        return to_dtype(x, cdtype)

    if token_scale is None:
        tau = q.new_ones(H, b, dtype=cdtype)
    else:
        tau = cast(token_scale)
        tau = tau if tau.dim() == 2 else tau.expand(H, b)
    inputs = {"q": cast(q), "k": cast(k), "v": cast(v), "eta": cast(eta), "carry": carry,
              "ln_weight": cast(ln_weight), "ln_bias": cast(ln_bias), "residual": residual,
              "tau": tau}
    current = None
    records_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad
        for x in (q, k, v, eta, ln_weight, ln_bias, token_scale, *carry.start,
                  *(carry.grads or ())))
    options = {"ln_weight": ln_weight, "ln_bias": ln_bias, "residual": residual,
               "mini_batch_size": b, "token_scale": token_scale}
    if _triton_runs(kind, q, k, v, eta, carry, backend, mode, records_grad, options):
        # The kernels read q, k, v in their own dtype (half inputs stay half in memory).
        o, carry = getattr(triton_kernels(), f"ttt_{kind}_triton")(
            q, k, v, **{n: inputs[n] for n in ("eta", "carry", "ln_weight", "ln_bias",
                                               "residual", "tau")},
            checkpoint_group=checkpoint_group)
    elif mode == "dual" and T == 1:
        # A decoding step: the token as one row, not a zero-padded b x b mini-batch (step.py).
        o, (carry, current) = _STEPS[kind](**inputs)
    elif mode == "dual" and isinstance(carry.pos, int):
        kernel, fixed = _KERNELS[kind]["dual"], {n: inputs[n] for n in (
            "ln_weight", "ln_bias", "residual", "tau")}

        def run(q, k, v, eta, carry):  # long CPU calls in pieces of whole mini-batches (_pieces)
            return kernel(q=q, k=k, v=v, eta=eta, carry=carry, checkpoint_group=checkpoint_group,
                          **fixed)

        o, carry = in_pieces(run, [inputs[n] for n in ("q", "k", "v", "eta")], carry,
                             piece_length(inputs["q"], max(Dk, Dv), b, carry.pos), carry.pos)
    else:
        extra = {"checkpoint_group": checkpoint_group} if mode == "dual" else {}
        o, carry = _KERNELS[kind][mode](**inputs, **extra)
    o = o if o.dtype == q.dtype else o.to(q.dtype)
    return o, (carry.final_state(tau, current) if output_final_state else None)


def _triton_runs(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                eta: torch.Tensor, carry: Carry, backend: str | None, mode: str,
                records_grad: bool, options: dict[str, Any]) -> bool:
    """Whether this call runs in the Triton kernels (ops/ttt/triton.py): the dispatcher's
    choice (ops/backend.py, from q's device, dtype, Dk and the mini-batch size), unless the
    kernels cannot take the call's head sizes (Dv > 128, or not multiples of 16), a state
    whose rows sit at their own places in the mini-batch (per-row ``pos``, decoding only) or,
    for an op whose backward kernels spill registers (outside ``BACKWARD_OPS`` of
    ops/ttt/triton.py; none today), a call that records gradients: an explicit
    choice of triton is then an error, the automatic one runs PyTorch. The automatic choice's
    trial call (ops/backend.py ``Trial``) starts from the carry's start weights, detached;
    ``options``: the op's other keyword arguments (LayerNorm, residual, mini-batch size, token
    scales)."""
    why = head_size_refusal(q.shape[-1], v.shape[-1])
    if why is None and isinstance(carry.pos, torch.Tensor):
        why = "a state with per-row places in the mini-batch (a long tensor pos)"
    elif why is None and records_grad and f"ttt_{kind}" not in getattr(
            triton_kernels(), "BACKWARD_OPS", (f"ttt_{kind}",)):
        why = (f"the ttt_{kind} backward kernel has no spill-free tiling (gradients are being "
               "recorded); without gradients (torch.no_grad) the forward kernel runs")

    def trial() -> Trial:
        def detached(x: Any) -> Any:
            return x.detach() if isinstance(x, torch.Tensor) else x

        return Trial(ttt_linear if kind == "linear" else ttt_mlp, (q, k, v, eta),
                     initial_state=tuple(detached(w) for w in carry.start),
                     **{n: detached(x) for n, x in options.items()})

    return triton_chosen(f"ttt_{kind}", q, backend, mode, options["mini_batch_size"], why, trial)


@float32_compute
def ttt_linear(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *,
    initial_state: Sequence[Any], ln_weight: torch.Tensor | None = None,
    ln_bias: torch.Tensor | None = None, residual: bool = False, mini_batch_size: int = 16,
    token_scale: torch.Tensor | None = None, output_final_state: bool = False, mode: str = "dual",
    cu_seqlens: torch.Tensor | None = None, checkpoint_group: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, TTTState | None]:
    """TTT-Linear (docs/maths.md 2.2-2.4): inner model f_res(z) = z W + b per head.

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
    exactly (its leading W, b are then ignored, being implied by the rest). Rows at different
    places (streams decoded together, see ``TTTLinear.stack_states``): pos may be a long tensor
    [B] of per-row places in [0, b), the sums zero in rows at place 0; such a state continues
    one token per call (T = 1, mode "dual") and stays in this per-row form.
    cu_seqlens: [N + 1] boundaries of documents packed in a batch of one; each document starts
    from ``initial_state`` (one state shared by all, batch 1) or from its own entry of a list of
    N states, and the final state is a list with one state per document (ops/_varlen.py).
    checkpoint_group: dual mode, while gradients are recorded: run the mini-batch scan in groups
    of this many mini-batches, each recomputed in the backward pass instead of keeping every
    mini-batch's weights (docs/maths.md 2.6: the paper uses 4); same results, less memory, one
    more forward of the scan. None (default) keeps everything, except on the Triton backend,
    whose backward always recomputes from checkpoints: there it is the checkpoint spacing
    (default 16 mini-batches).
    backend: "triton" (the dual form's kernels, ops/ttt/triton.py: CUDA, float16 or bfloat16
    q, k, v, Dk and Dv multiples of 16 up to 128, mini_batch_size <= 64, mode "dual"; TTT-MLP's
    forward kernel only, without gradients: its backward kernel exists but spills), "torch", or None for the automatic choice
    (ops/backend.py: triton where it can run the call, except one-token calls). An explicit
    choice that cannot run the call is a ValueError saying why.
    """
    return _ttt("linear", q, k, v, eta, initial_state=initial_state, ln_weight=ln_weight,
                ln_bias=ln_bias, residual=residual, mini_batch_size=mini_batch_size,
                token_scale=token_scale, output_final_state=output_final_state, mode=mode,
                cu_seqlens=cu_seqlens, checkpoint_group=checkpoint_group, backend=backend)


@float32_compute
def ttt_mlp(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *,
    initial_state: Sequence[Any], ln_weight: torch.Tensor | None = None,
    ln_bias: torch.Tensor | None = None, residual: bool = False, mini_batch_size: int = 16,
    token_scale: torch.Tensor | None = None, output_final_state: bool = False, mode: str = "dual",
    cu_seqlens: torch.Tensor | None = None, checkpoint_group: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, TTTState | None]:
    """TTT-MLP (docs/maths.md 2.2-2.4): inner model f_res(z) = gelu_tanh(z W1 + b1) W2 + b2 per
    head, hidden size 4 Dk.

    initial_state (required): (W1 [B or 1, H, Dk, 4Dk], b1 [B or 1, H, 4Dk] or None,
    W2 [B or 1, H, 4Dk, Dv], b2 [B or 1, H, Dv] or None), or a state returned by an earlier call;
    mid-mini-batch states are (W1, b1, W2, b2, start W1, b1, W2, b2, sums W1, b1, W2, b2, pos).
    Every other argument, the output and the state semantics are as in ``ttt_linear``.
    In dual mode the mini-batch scan has a hand-written backward pass (ops/ttt/mlp_scan.py)
    that keeps per-token rows, not per-mini-batch weights; ``checkpoint_group`` then keeps the
    weights entering each group and runs its steps again in the backward pass. Under
    torch.compile the plain scan, differentiated by autograd, is traced instead.
    """
    return _ttt("mlp", q, k, v, eta, initial_state=initial_state, ln_weight=ln_weight,
                ln_bias=ln_bias, residual=residual, mini_batch_size=mini_batch_size,
                token_scale=token_scale, output_final_state=output_final_state, mode=mode,
                cu_seqlens=cu_seqlens, checkpoint_group=checkpoint_group, backend=backend)
