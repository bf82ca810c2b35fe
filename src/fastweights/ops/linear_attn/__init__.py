"""Linear attention, the sum rule of fast weight programmers (docs/maths.md 1.3): ``linear_attn``
and its state. The forms: ``naive.py`` (the oracle), ``recurrent.py`` (token by token),
``chunk.py`` (chunked, the default); on CUDA fla's kernels (``fla.py``) or this project's
(``triton.py``).

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ..._checks import (
    check_bool,
    check_finite_float,
    check_mode,
    check_nonneg_float,
    check_positive_int,
    check_qkv,
    state_dtype,
)
from .._autocast import float32_states, products_dtype
from .._modes import RECURRENT_MODES
from .._pieces import in_pieces, piece_length
from .._state import LinearAttnState
from .._steps import check_step_qkv, wide
from .._varlen import run_packed, stack_packed_states
from ..backend import Kernel, Trial, choose_backend, optional_module, register
from .chunk import linear_attn_chunk
from .fla import fla_linear_attn
from .naive import linear_attn_naive
from .recurrent import linear_attn_recurrent
from .speeds import SPEEDS

MODES = RECURRENT_MODES
def _triton() -> ModuleType:
    from . import triton

    return triton


triton_kernels = optional_module(_triton)  # this op's triton.py; None without triton


register("linear_attn", fla=Kernel(), triton=Kernel(kernels=triton_kernels),
         chunk_sizes={"cpu": 64}, speeds=SPEEDS)


@float32_states
def linear_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, normalize: bool = False,
    eps: float = 1e-6, scale: float = 1.0,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None, backend: str | None = None,
) -> tuple[torch.Tensor, LinearAttnState | None]:
    """Causal linear attention / sum-rule fast weights (docs/maths.md 1.3).

    q, k: [B, T, H, Dk] (already feature-mapped); v: [B, T, H, Dv].
    State: a ``LinearAttnState`` (S [B, H, Dk, Dv], z [B, H, Dk]), S_t = S_{t-1} + k_t^T v_t, z_t = z_{t-1} + k_t.
    o_t = (scale q_t) S_t, divided by ((scale q_t) . z_t + eps) when ``normalize``.
    Returns (o [B, T, H, Dv] in q's dtype, (S, z) in float32/float64 or None).
    ``cu_seqlens`` [N + 1]: packed documents in a batch of one, state reset at each boundary;
    initial/final states are then lists with one state per document (see ops/_varlen.py).
    ``backend``: "fla", "triton", "torch" or None (automatic); see ops/backend.py.

    Precision: float32 (float64 stays float64), autocast switched off inside, except on the CPU
    bfloat16 product path: under ``torch.autocast("cpu", dtype=torch.bfloat16)``, with
    ``FASTWEIGHTS_CPU_BF16`` "on", or "auto"/unset on a CPU with AMX-BF16 or AVX512-BF16, the
    chunked form (T > 1, torch backend, float32 compute) runs its four products (K^T V, Q K^T,
    scores V, Q S_prev) with bfloat16 operands, each result widened to float32 before it is
    added to anything; S, z, the sum of chunk states and the denominator stay float32 (within
    about 6 bfloat16 roundings of the terms' magnitudes; ops/_autocast.py, ops/_chunks.py).
    Any other value of the variable is a ValueError. Outputs come back in q's dtype, states in
    float32 either way.
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    check_bool("normalize", normalize)
    check_nonneg_float("eps", eps)
    check_finite_float("scale", scale)
    check_bool("output_final_state", output_final_state)
    check_mode(mode, MODES)
    check_positive_int("chunk_size", chunk_size)
    trial = Trial(linear_attn, (q, k, v), normalize=normalize, eps=eps, scale=scale,
                  chunk_size=chunk_size)
    if cu_seqlens is not None:
        if choose_backend("linear_attn", q, backend, mode, chunk_size, trial) == "fla":  # whole
            bounds, (S0, z0) = stack_packed_states(
                initial_state, cu_seqlens, q,
                lambda st: (LinearAttnState.zeros(1, H, Dk, Dv, q) if st is None
                            else LinearAttnState.check(st, 1, H, Dk, Dv, q)))
            o, state = fla_linear_attn(q, k, v, normalize=normalize, eps=eps, scale=scale, S0=S0,
                                       z0=z0, output_final_state=output_final_state,
                                       cu_seqlens=cu_seqlens, bounds=bounds)
            if state is None:
                return o, None
            return o, [LinearAttnState(S, z) for S, z in zip(state[0].split(1), state[1].split(1))]
        return run_packed(linear_attn, (q, k, v), cu_seqlens, initial_state, output_final_state,
                          normalize=normalize, eps=eps, scale=scale, mode=mode, chunk_size=chunk_size,
                          backend=backend)
    cdtype = state_dtype(q.dtype)
    if initial_state is None:
        S0, z0 = LinearAttnState.zeros(B, H, Dk, Dv, q)
    else:
        S0, z0 = LinearAttnState.check(initial_state, B, H, Dk, Dv, q)
    chosen = choose_backend("linear_attn", q, backend, mode, chunk_size, trial)
    if chosen == "fla":
        o, state = fla_linear_attn(q, k, v, normalize=normalize, eps=eps, scale=scale, S0=S0,
                                   z0=z0, output_final_state=output_final_state)
        return o, (LinearAttnState(*state) if state is not None else None)
    if chosen == "triton":
        # The kernels take the inputs in their own dtype and upcast on chip (states float32).
        o, S, z = triton_kernels().linear_attn_triton(q * scale if scale != 1.0 else q, k, v,
                                                      S0, z0, normalize, eps, min(chunk_size, T))
        return o.to(q.dtype), (LinearAttnState(S, z) if output_final_state else None)
    args = {"q": q.to(cdtype) if scale == 1.0 else q.to(cdtype) * scale, "k": k.to(cdtype), "v": v.to(cdtype),
            "normalize": normalize, "eps": eps}
    if mode == "chunk" and T > 1:
        C, products = min(chunk_size, T), products_dtype(cdtype)

        def run(q, k, v, state):  # long CPU calls go in pieces of whole chunks (ops/_pieces.py)
            o, S, z = linear_attn_chunk(q=q, k=k, v=v, normalize=normalize, eps=eps, S0=state[0],
                                        z0=state[1], chunk_size=min(C, q.shape[1]),
                                        products=products)
            return o, (S, z)

        o, (S, z) = in_pieces(run, [args["q"], args["k"], args["v"]], (S0, z0),
                              piece_length(args["q"], max(Dk, Dv), C))
    elif mode == "naive":
        o, S, z = linear_attn_naive(**args, S0=S0, z0=z0)
    else:
        # mode="recurrent", or a decoding step (T = 1) of mode="chunk": one token of the
        # recurrence is the same arithmetic without padding the token to a whole chunk.
        o, S, z = linear_attn_recurrent(**args, S=S0, z=z0)
    return o.to(q.dtype), (LinearAttnState(S, z) if output_final_state else None)


@float32_states
def linear_attn_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, state: LinearAttnState | None = None,
    normalize: bool = False, eps: float = 1e-6, scale: float = 1.0,
) -> tuple[torch.Tensor, LinearAttnState]:
    """One token of ``linear_attn`` (docs/maths.md 1.3): q, k [B, 1, H, Dk], v [B, 1, H, Dv],
    ``state`` a ``LinearAttnState`` (None: the empty state). Returns (o [B, 1, H, Dv] in q's
    dtype, the state after the token). The same arithmetic as the op's one-token call; only
    shapes are checked (a decoding step's budget), the state is not copied, and nothing is
    read back to the host, so the step traces whole (``torch.compile(fullgraph=True)``)."""
    B, H, Dk, Dv = check_step_qkv(q, k, v)
    cdtype = state_dtype(q.dtype)
    if state is None:
        S, z = LinearAttnState.zeros(B, H, Dk, Dv, q)
    else:
        S, z = LinearAttnState.check(state, B, H, Dk, Dv, q, "state")
    qc = wide(q, cdtype) if scale == 1.0 else wide(q, cdtype) * scale
    o, S, z = linear_attn_recurrent(qc, wide(k, cdtype), wide(v, cdtype), S, z, normalize, eps)
    return (o if o.dtype == q.dtype else o.to(q.dtype)), LinearAttnState(S, z)
