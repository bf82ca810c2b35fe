"""Decayed linear attention of TransNormerLLM / Lightning Attention (docs/maths.md 3.5):
``decay_linear_attn``. Its state is the single matrix S [B, H, Dk, Dv], a plain tensor.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim.
"""

from __future__ import annotations

import torch

from ..._checks import (
    check_arg,
    check_bool,
    check_finite_float,
    check_mode,
    check_positive_int,
    check_qkv,
    check_tensor,
    matrix_state,
    state_dtype,
)
from .._autocast import float32_compute
from .._modes import RECURRENT_MODES, reads_allowed
from .._pieces import in_pieces, piece_length
from .._steps import check_step_qkv, wide
from .._varlen import run_packed, stack_packed_states
from ..backend import Kernel, Trial, choose_backend, register
from .chunk import decay_linear_attn_chunk
from .fla import fla_decay_linear_attn
from .naive import decay_linear_attn_naive
from .recurrent import decay_linear_attn_recurrent

MODES = RECURRENT_MODES


register("decay_linear_attn", fla=Kernel())


@float32_compute
def decay_linear_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, *, scale: float = 1.0,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    mode: str = "chunk", chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal linear attention with a per-head decay, no denominator (docs/maths.md 3.5).

    q, k: [B, T, H, Dk] (already activated); v: [B, T, H, Dv]; decay: [H], lambda_h in (0, 1]
    (lambda = 1 is plain un-normalised linear attention). S_t = lambda_h S_{t-1} + k_t^T v_t,
    o_t = (scale q_t) S_t. State S [B, H, Dk, Dv]. Differentiable in q, k, v, decay and the state.
    Returns (o [B, T, H, Dv] in q's dtype, S in float32/float64 or None).
    ``cu_seqlens`` [N + 1]: packed documents in a batch of one, the state reset at each boundary;
    initial/final states are then lists with one state per document (ops/_varlen.py).
    ``backend``: "fla" (simple GLA kernels), "torch" or None (automatic); see ops/backend.py.
    """
    B, _, H, Dk, Dv = check_qkv(q, k, v)
    check_tensor("decay", decay, 1, "[H]")
    check_arg("decay", decay, (H,), "[H]", q)
    # A check of decay's values is a data-dependent branch: torch.compile(fullgraph=True) and
    # torch.export cannot trace it, so traced programs skip it (the layers build decay in range).
    if reads_allowed() and not bool(((decay > 0) & (decay <= 1)).all()):
        raise ValueError(
            f"decay must lie in (0, 1] for every head, got values {decay.detach().cpu().tolist()}"
        )
    check_finite_float("scale", scale)
    check_bool("output_final_state", output_final_state)
    check_mode(mode, MODES)
    check_positive_int("chunk_size", chunk_size)
    trial = Trial(decay_linear_attn, (q, k, v), decay=decay.detach(), scale=scale,
                  chunk_size=chunk_size)
    if cu_seqlens is not None:
        if choose_backend("decay_linear_attn", q, backend, mode, chunk_size, trial) == "fla":
            bounds, (S0,) = stack_packed_states(  # fla takes the packed batch whole
                initial_state, cu_seqlens, q,
                lambda st: (matrix_state(st, (1, H, Dk, Dv), q, state_dtype(q.dtype)),))
            o, S = fla_decay_linear_attn(q, k, v, decay, scale=scale, S0=S0,
                                         output_final_state=output_final_state,
                                         cu_seqlens=cu_seqlens, bounds=bounds)
            return o, (list(S.split(1)) if output_final_state else None)
        return run_packed(decay_linear_attn, (q, k, v), cu_seqlens, initial_state,
                          output_final_state, decay=decay, scale=scale, mode=mode,
                          chunk_size=chunk_size, backend=backend)
    cdtype = state_dtype(q.dtype)
    S0 = matrix_state(initial_state, (B, H, Dk, Dv), q, cdtype)
    if choose_backend("decay_linear_attn", q, backend, mode, chunk_size, trial) == "fla":
        return fla_decay_linear_attn(q, k, v, decay, scale=scale, S0=S0,
                                     output_final_state=output_final_state)
    if mode == "chunk" and q.shape[1] > 1:  # the chunk form scales q itself, on its small tables
        lam = decay.to(cdtype)

        def run(q, k, v, S):  # long CPU calls go in pieces of whole chunks (ops/_pieces.py)
            return decay_linear_attn_chunk(q, k, v, lam, S, chunk_size, scale)

        qw = q.to(cdtype)
        o, S = in_pieces(run, [qw, k.to(cdtype), v.to(cdtype)], S0,
                         piece_length(qw, max(q.shape[-1], v.shape[-1]), min(chunk_size, q.shape[1])))
        return o.to(q.dtype), (S if output_final_state else None)
    args = (q.to(cdtype) if scale == 1.0 else q.to(cdtype) * scale, k.to(cdtype), v.to(cdtype),
            decay.to(cdtype), S0)
    if mode == "naive":
        o, S = decay_linear_attn_naive(*args)
    else:  # mode="recurrent", or a decoding step (T = 1) of mode="chunk" (see linear_attn)
        o, S = decay_linear_attn_recurrent(*args)
    return o.to(q.dtype), (S if output_final_state else None)


@float32_compute
def decay_linear_attn_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor | None, *,
    state: torch.Tensor | None = None, scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of ``decay_linear_attn`` (docs/maths.md 3.5): q, k [B, 1, H, Dk], v
    [B, 1, H, Dv], decay [H] (lambda_h; its values are not checked, which would read them back
    to the host) or None (lambda = 1: un-normalised linear attention without a normaliser to
    carry, NormAttention without decay), ``state`` S [B, H, Dk, Dv] (None: zeros). Returns
    (o [B, 1, H, Dv] in q's dtype, S after the token); see ``linear_attn_step``."""
    B, H, Dk, Dv = check_step_qkv(q, k, v)
    cdtype = state_dtype(q.dtype)
    if decay is not None:
        check_arg("decay", decay, (H,), "[H]", q)
        decay = wide(decay, cdtype)
    S = matrix_state(state, (B, H, Dk, Dv), q, cdtype, "state")
    qc = wide(q, cdtype) if scale == 1.0 else wide(q, cdtype) * scale
    o, S = decay_linear_attn_recurrent(qc, wide(k, cdtype), wide(v, cdtype), decay, S)
    return (o if o.dtype == q.dtype else o.to(q.dtype)), S
