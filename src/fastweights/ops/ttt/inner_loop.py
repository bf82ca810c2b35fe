"""The public TTT ops ``ttt_linear`` and ``ttt_mlp`` (docs/maths.md 2.2-2.4) and their one-token
steps ``ttt_linear_step`` and ``ttt_mlp_step``: argument checks, the ``mode=`` switch over
chunk.py (the dual form) / primal.py / naive.py and recurrent.py (one token), the Triton
kernels' registration, and the state in and out: the weights at a mini-batch boundary, else a
``TTTState`` (the open mini-batch's rows), which the parallel forms take as sums (``Carry``)
once, at entry.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, b mini-batch size.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..._checks import (
    check_arg,
    check_bool,
    check_choice,
    check_device,
    check_documents,
    check_mode,
    check_positive_int,
    check_qkv,
    check_tensor,
    state_dtype,
)
from .._autocast import float32_compute
from .._modes import TTT_MODES, reads_allowed
from .._pieces import in_pieces, piece_length
from .._varlen import run_packed
from ..backend import Kernel, Trial, choose_backend, register
from .chunk import ttt_linear_dual, ttt_mlp_dual
from .common import Carry, TTTState, check_state, to_dtype
from .kernels import decode_kernels, head_size_refusal, triton_kernels
from .naive import linear_f_res, mlp_f_res, ttt_naive
from .primal import ttt_linear_primal, ttt_mlp_primal
from .recurrent import (
    group_norm,
    layer_norm_rows,
    linear_token,
    mlp_token,
    state_after,
    with_rows,
)

MODES = TTT_MODES


TTTOpState = tuple[Any, ...] | TTTState  # the weights at a mini-batch boundary, else a TTTState

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
_TOKENS = {"linear": linear_token, "mlp": mlp_token}


def _refuse_dual(q: torch.Tensor, facts: Mapping[str, Any]) -> str | None:
    """What else of a call the dual form's kernels (ops/ttt/triton.py) cannot take (``facts``:
    Dv, the op's name, whether it records gradients; q gives Dk): head sizes
    that are not multiples of 16 or above 128, or, for an op whose backward kernels spill
    registers (outside ``BACKWARD_OPS``; none today), a call that records gradients."""
    why = head_size_refusal(q.shape[-1], facts.get("Dv", q.shape[-1]))
    op = facts.get("op", "")
    if why is None and facts.get("records_grad") and op not in getattr(
            triton_kernels(), "BACKWARD_OPS", (op,)):
        why = (f"the {op} backward kernel has no spill-free tiling (gradients are being "
               "recorded); without gradients (torch.no_grad) the forward kernel runs")
    return why


def _refuse_step(q: torch.Tensor, facts: Mapping[str, Any]) -> str | None:
    """What else of a one-token call the step's kernel (ops/ttt/triton_decode.py) cannot take
    (``facts``: Dv, per_row, weights_dtype, records_grad):
    the dual kernels' head sizes, per-row places, inner weights not in float32, gradients being
    recorded (it has no backward)."""
    why = head_size_refusal(q.shape[-1], facts.get("Dv", q.shape[-1]))
    weights = facts.get("weights_dtype", torch.float32)
    if why is None and facts.get("per_row"):
        why = "a state with per-row places in the mini-batch (a long tensor pos)"
    elif why is None and weights != torch.float32:
        why = f"{weights} inner weights (the kernel keeps them in float32)"
    elif why is None and facts.get("records_grad"):
        why = ("the decoding kernel has no backward pass (gradients are being recorded); "
               "without gradients (torch.no_grad) it runs")
    return why


# The Triton kernels: the dual form, a mini-batch per step (ops/ttt/triton.py), and the
# one-token step (ops/ttt/triton_decode.py), which the automatic choice takes for one-token
# calls; fla has none.
for _op in ("ttt_linear", "ttt_mlp"):
    register(_op, triton=(
        Kernel(mode="dual", chunk_name="mini_batch_size", kernels=triton_kernels,
               refuse=_refuse_dual),
        Kernel(mode="dual", chunk_name="mini_batch_size", kernels=decode_kernels,
               one_token=True, refuse=_refuse_step)))


def _check_call(kind: str, q: Any, k: Any, v: Any, eta: Any, ln_weight: Any, ln_bias: Any,
                residual: Any, mini_batch_size: Any, token_scale: Any
                ) -> tuple[int, int, int, int, int, int]:
    """The checks every TTT call makes (op and step). Returns (B, T, H, Dk, Dv, b)."""
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    check_arg("eta", eta, (B, T, H), "[B, T, H]", q)
    b = check_positive_int("mini_batch_size", mini_batch_size)
    check_bool("residual", residual)
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
    return B, T, H, Dk, Dv, b


def _records_grad(*xs: Any) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


def _ttt(
    kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *,
    initial_state: Any, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None,
    residual: bool, mini_batch_size: int, token_scale: torch.Tensor | None,
    output_final_state: bool, mode: str, cu_seqlens: Any = None,
    checkpoint_group: int | None = None, backend: str | None = None,
) -> tuple[torch.Tensor, TTTOpState | None]:
    B, T, H, Dk, Dv, b = _check_call(kind, q, k, v, eta, ln_weight, ln_bias, residual,
                                     mini_batch_size, token_scale)
    if checkpoint_group is not None:
        check_positive_int("checkpoint_group", checkpoint_group)
    check_mode(mode, MODES)
    check_bool("output_final_state", output_final_state)
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
    state = check_state(initial_state, kind, B, H, Dk, Dv, b, q)
    per_row = isinstance(state, TTTState) and isinstance(state.pos, torch.Tensor)
    if per_row and (T != 1 or mode != "dual"):
        raise ValueError(
            "an initial_state with per-row places in the mini-batch (a long tensor pos) is "
            f"continued one token per call in mode='dual', got T={T}, mode={mode!r}; run rows "
            "at different places with more tokens as separate calls")
    if mode == "dual" and T == 1:
        # A one-token call: the token as one row (recurrent.py, or its kernel), not a
        # zero-padded b x b mini-batch.
        o, final = _step(kind, q, k, v, eta, state, ln_weight, ln_bias, residual, b,
                         token_scale, None, backend, "read" if reads_allowed() else "where")
        return o, (final if output_final_state else None)

    cdtype = state_dtype(q.dtype)

    def cast(x: torch.Tensor | None) -> torch.Tensor | None:
        return to_dtype(x, cdtype)

    tau = _tau(token_scale, q, H, b, cdtype)
    carry = (Carry(state.start, state.sums(), state.pos) if isinstance(state, TTTState)
             else Carry(state, None, 0))
    inputs = {"q": cast(q), "k": cast(k), "v": cast(v), "eta": cast(eta), "carry": carry,
              "ln_weight": cast(ln_weight), "ln_bias": cast(ln_bias), "residual": residual,
              "tau": tau}
    options = {"ln_weight": ln_weight, "ln_bias": ln_bias, "residual": residual,
               "mini_batch_size": b, "token_scale": token_scale}

    def trial() -> Trial:  # the automatic choice's trial call, from the start weights, detached
        def detached(x: Any) -> Any:
            return x.detach() if isinstance(x, torch.Tensor) else x

        return Trial(ttt_linear if kind == "linear" else ttt_mlp, (q, k, v, eta),
                     initial_state=tuple(detached(w) for w in carry.start),
                     **{n: detached(x) for n, x in options.items()})

    facts = {"op": f"ttt_{kind}", "Dv": Dv, "records_grad": _records_grad(
        q, k, v, eta, ln_weight, ln_bias, token_scale, *carry.start, *(carry.grads or ()))}
    if choose_backend(f"ttt_{kind}", q, backend, mode, b, trial, facts) == "triton":
        # The kernels read q, k, v in their own dtype (half inputs stay half in memory).
        o, carry = getattr(triton_kernels(), f"ttt_{kind}_triton")(
            q, k, v, **{n: inputs[n] for n in ("eta", "carry", "ln_weight", "ln_bias",
                                               "residual", "tau")},
            checkpoint_group=checkpoint_group)
    elif mode == "dual":
        kernel, fixed = _KERNELS[kind]["dual"], {n: inputs[n] for n in (
            "ln_weight", "ln_bias", "residual", "tau")}

        def run(q, k, v, eta, carry):  # long CPU calls in pieces of whole mini-batches (_pieces)
            return kernel(q=q, k=k, v=v, eta=eta, carry=carry, checkpoint_group=checkpoint_group,
                          **fixed)

        o, carry = in_pieces(run, [inputs[n] for n in ("q", "k", "v", "eta")], carry,
                             piece_length(inputs["q"], max(Dk, Dv), b, carry.pos), carry.pos)
    else:
        o, carry = _KERNELS[kind][mode](**inputs)
    o = o if o.dtype == q.dtype else o.to(q.dtype)
    if not output_final_state:
        return o, None
    # The open mini-batch as rows (the form a one-token step continues), computed once here.
    return o, state_after(kind, carry.start, carry.pos, state, inputs["k"], inputs["v"],
                          inputs["eta"], layer_norm_rows(inputs["ln_weight"], inputs["ln_bias"]),
                          residual)


def _tau(token_scale: torch.Tensor | None, q: torch.Tensor, H: int, b: int,
         cdtype: torch.dtype) -> torch.Tensor:
    """tau [H, b] in the compute dtype (ones for None)."""
    if token_scale is None:
        return q.new_ones(H, b, dtype=cdtype)
    tau = to_dtype(token_scale, cdtype)
    return tau if tau.dim() == 2 else tau.expand(H, b)


def _step(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor,
          state: Any, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None,
          residual: bool, b: int, token_scale: torch.Tensor | None,
          values: Sequence[float] | None, backend: str | None, commit: str,
          ) -> tuple[torch.Tensor, TTTOpState]:
    """One token from a checked ``state`` (weights or a TTTState): the step's kernel where the
    dispatcher takes it (ops/ttt/triton_decode.py), else the rows form of recurrent.py."""
    Dv = v.shape[-1]
    rows = state if isinstance(state, TTTState) else with_rows(state)
    facts = {"op": f"ttt_{kind}", "Dv": Dv,
             "per_row": not isinstance(rows.pos, int), "weights_dtype": rows.start[0].dtype,
             "records_grad": _records_grad(q, k, v, eta, ln_weight, ln_bias, token_scale,
                                           *rows.start, *rows.rows)}
    options = {"ln_weight": ln_weight, "ln_bias": ln_bias, "residual": residual,
               "mini_batch_size": b, "token_scale": token_scale}

    def trial() -> Trial:
        def step(q, k, v, eta, *, backend, output_final_state, **kw):
            del output_final_state  # Trial asks every op for it; a step always returns it
            return (ttt_linear_step if kind == "linear" else ttt_mlp_step)(
                q, k, v, eta, backend=backend, **kw)

        return Trial(step, (q, k, v, eta), state=state, **options)

    if choose_backend(f"ttt_{kind}", q, backend, "dual", b, trial, facts) == "triton":
        tau = q.new_ones(b, dtype=torch.float32) if token_scale is None else token_scale
        kernels = decode_kernels()
        run = kernels.ttt_linear_decode_triton if kind == "linear" else \
            kernels.ttt_mlp_decode_triton
        o, committed, new_rows = run(q, k, v, eta, rows, ln_weight, ln_bias, residual, tau)
        if committed is not None:  # the token completed the mini-batch
            return o, committed
        return o, TTTState(rows.start, new_rows, rows.pos + 1)
    cdtype = state_dtype(q.dtype)

    def cast(x: torch.Tensor | None) -> torch.Tensor | None:
        return to_dtype(x, cdtype)

    tau = q.new_ones(b, dtype=cdtype) if token_scale is None else cast(token_scale)
    if values is not None and (tau.dim() != 1 or len(values) != b or torch.is_grad_enabled()
                               or torch.compiler.is_compiling()):
        values = None
    o, final = _TOKENS[kind](cast(q), cast(k), cast(v), cast(eta), rows,
                             group_norm(cast(ln_weight), cast(ln_bias)), residual, tau, values,
                             commit)
    return (o if o.dtype == q.dtype else o.to(q.dtype)), final


def _ttt_step(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor,
              state: Any, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None,
              residual: bool, mini_batch_size: int, token_scale: torch.Tensor | None,
              token_scale_values: Sequence[float] | None, backend: str | None, commit: str,
              ) -> tuple[torch.Tensor, TTTOpState]:
    B, T, H, Dk, Dv, b = _check_call(kind, q, k, v, eta, ln_weight, ln_bias, residual,
                                     mini_batch_size, token_scale)
    if T != 1:
        raise ValueError(f"a step takes one token: q must have shape [B, 1, H, Dk], got "
                         f"{tuple(q.shape)} (ttt_{kind} takes T tokens)")
    check_choice("commit", commit, ("read", "where"))
    state = check_state(state, kind, B, H, Dk, Dv, b, q, "state")
    return _step(kind, q, k, v, eta, state, ln_weight, ln_bias, residual, b, token_scale,
                 token_scale_values, backend, commit)


@float32_compute
def ttt_linear(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *,
    initial_state: Any, ln_weight: torch.Tensor | None = None,
    ln_bias: torch.Tensor | None = None, residual: bool = False, mini_batch_size: int = 16,
    token_scale: torch.Tensor | None = None, output_final_state: bool = False, mode: str = "dual",
    cu_seqlens: torch.Tensor | None = None, checkpoint_group: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, TTTOpState | None]:
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
    the last token, in float32 (float64 for float64 inputs), with batch B, when the call ends on
    a mini-batch boundary; when it ends inside a mini-batch (pos = (p + T) mod b != 0) it is a
    ``TTTState`` (start weights W_0, b_0 of that mini-batch, the rows of its pos tokens: their
    inputs and eta-scaled output gradients at W_0, and pos), what one-token steps carry; its
    ``weights(token_scale)`` are the current weights W_0 - tau_pos sum_j x_j^T eg_j. Feeding
    it back continues the mini-batch exactly. Rows at different places (streams decoded
    together, ``TTTState.stack``, ``TTTLinear.stack_states``): pos may be a long tensor [B] of
    per-row places in [0, b) with b-row buffers; such a state continues one token per call
    (T = 1, mode "dual") and stays in this per-row form.
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
    q, k, v, Dk and Dv multiples of 16 up to 128, mini_batch_size <= 64, mode "dual"; forward
    and backward for the ops in ops/ttt/triton.py's ``BACKWARD_OPS``, both today), "torch", or
    None for the automatic choice (ops/backend.py: triton where it can run the call). A
    one-token call in mode "dual" is ``ttt_linear_step`` (its own kernel). An explicit choice
    that cannot run the call is a ValueError saying why.
    """
    return _ttt("linear", q, k, v, eta, initial_state=initial_state, ln_weight=ln_weight,
                ln_bias=ln_bias, residual=residual, mini_batch_size=mini_batch_size,
                token_scale=token_scale, output_final_state=output_final_state, mode=mode,
                cu_seqlens=cu_seqlens, checkpoint_group=checkpoint_group, backend=backend)


@float32_compute
def ttt_mlp(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *,
    initial_state: Any, ln_weight: torch.Tensor | None = None,
    ln_bias: torch.Tensor | None = None, residual: bool = False, mini_batch_size: int = 16,
    token_scale: torch.Tensor | None = None, output_final_state: bool = False, mode: str = "dual",
    cu_seqlens: torch.Tensor | None = None, checkpoint_group: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, TTTOpState | None]:
    """TTT-MLP (docs/maths.md 2.2-2.4): inner model f_res(z) = gelu_tanh(z W1 + b1) W2 + b2 per
    head, hidden size 4 Dk.

    initial_state (required): (W1 [B or 1, H, Dk, 4Dk], b1 [B or 1, H, 4Dk] or None,
    W2 [B or 1, H, 4Dk, Dv], b2 [B or 1, H, Dv] or None), or a state returned by an earlier call
    (inside a mini-batch a ``TTTState``, the rows (X1, EG1, X2, EG2) of the inner MLP's two
    layers).
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


@float32_compute
def ttt_linear_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *, state: Any,
    ln_weight: torch.Tensor | None = None, ln_bias: torch.Tensor | None = None,
    residual: bool = False, mini_batch_size: int = 16, token_scale: torch.Tensor | None = None,
    token_scale_values: Sequence[float] | None = None, backend: str | None = None,
    commit: str = "read",
) -> tuple[torch.Tensor, TTTOpState]:
    """One token of ``ttt_linear`` (docs/maths.md 2.3): q, k [B, 1, H, Dk], v [B, 1, H, Dv],
    eta [B, 1, H]; ``state`` the op's state (the weights at a mini-batch boundary, e.g. the
    initial weights, a batch of 1 broadcasting; else a ``TTTState``); other arguments as the
    op's. Returns (o [B, 1, H, Dv] in q's dtype, the state after the token: the weights when
    the token completes the mini-batch at an int place, else a ``TTTState``). The token joins
    the open mini-batch's rows and weights are written only when it completes.

    Shapes are checked, nothing else: no value is read back to the host, except for per-row
    places (a long tensor pos) with ``commit="read"`` (the default), which reads which rows
    complete their mini-batch and commits only those; ``commit="where"`` forms every row's
    commit and keeps it where the row completes (no read back: a captured CUDA graph, and
    what ``torch.compile`` traces). ``token_scale_values``: token_scale's entries as floats,
    which a caller decoding without gradients may pass to save a step a few operations (the
    TTT layers keep them). ``backend``: "triton" (ops/ttt/triton_decode.py: CUDA, float16 or
    bfloat16 q, k, v, head sizes multiples of 16 up to 128, mini_batch_size <= 64, one place
    for every row, float32 weights, no gradients recorded), "torch", or None (the automatic
    choice, ops/backend.py)."""
    return _ttt_step("linear", q, k, v, eta, state, ln_weight, ln_bias, residual,
                     mini_batch_size, token_scale, token_scale_values, backend, commit)


@float32_compute
def ttt_mlp_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *, state: Any,
    ln_weight: torch.Tensor | None = None, ln_bias: torch.Tensor | None = None,
    residual: bool = False, mini_batch_size: int = 16, token_scale: torch.Tensor | None = None,
    token_scale_values: Sequence[float] | None = None, backend: str | None = None,
    commit: str = "read",
) -> tuple[torch.Tensor, TTTOpState]:
    """One token of ``ttt_mlp``; arguments, result and checks as ``ttt_linear_step``'s."""
    return _ttt_step("mlp", q, k, v, eta, state, ln_weight, ln_bias, residual,
                     mini_batch_size, token_scale, token_scale_values, backend, commit)
