"""The delta rule (DeltaNet), read after write (SPEC.md 1.4): ``delta_rule``. Its state is the
single matrix S [B, H, Dk, Dv], a plain tensor (``o, S = delta_rule(...)``).

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
    matrix_state,
    state_dtype,
)
from .._autocast import float32_states, products_dtype
from .._varlen import run_packed, stack_packed_states
from ..backend import choose_backend, triton_kernels
from .chunk import delta_rule_chunk
from .fla import fla_delta_rule
from .linear_attention import MODES
from .naive import delta_rule_naive
from .recurrent import delta_rule_recurrent


@float32_states
def delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, scale: float = 1.0,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    mode: str = "chunk", chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delta-rule fast weights, read after write (SPEC 1.4).

    q, k: [B, T, H, Dk] (feature-mapped and sum-normalised by the caller); v: [B, T, H, Dv];
    beta: [B, T, H] write strengths (any floating dtype: like the state, it is used in the
    compute dtype, float32 or float64, so a float32 gate may drive bfloat16 q, k, v).
    S_t = S_{t-1} + k_t^T beta_t (v_t - k_t S_{t-1}); o_t = (scale q_t) S_t. State S [B, H, Dk, Dv].
    Returns (o [B, T, H, Dv] in q's dtype, S in float32/float64 or None).
    ``cu_seqlens`` [N + 1]: packed documents in a batch of one (see linear_attn); ``backend``
    as for linear_attn.

    Precision as for linear_attn: on the CPU bfloat16 product path (CPU bfloat16 autocast and
    ``FASTWEIGHTS_CPU_BF16`` "on", or "auto" on a CPU with AMX-BF16 / AVX512-BF16) the chunked
    form takes bfloat16 operands in U0 = Tm V, Q K^T, tril(Q K^T) U and Q S (and the matching
    backward products); K K^T, the triangular solve, W = Tm K and the state hand-off between
    chunks stay float32, as does the returned state (see ops/fwp/chunk.py).
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    check_arg("beta", beta, (B, T, H), "[B, T, H]", q)
    check_finite_float("scale", scale)
    check_bool("output_final_state", output_final_state)
    check_mode(mode, MODES)
    check_positive_int("chunk_size", chunk_size)
    if cu_seqlens is not None:
        if choose_backend("delta_rule", q, backend, mode, chunk_size) == "fla":  # whole batch
            bounds, (S0,) = stack_packed_states(
                initial_state, cu_seqlens, q,
                lambda st: (matrix_state(st, (1, H, Dk, Dv), q, state_dtype(q.dtype)),))
            o, S = fla_delta_rule(q, k, v, beta, scale=scale, S0=S0,
                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                  bounds=bounds)
            return o, (list(S.split(1)) if output_final_state else None)
        return run_packed(delta_rule, (q, k, v, beta), cu_seqlens, initial_state,
                          output_final_state, scale=scale, mode=mode, chunk_size=chunk_size,
                          backend=backend)
    cdtype = state_dtype(q.dtype)
    S0 = matrix_state(initial_state, (B, H, Dk, Dv), q, cdtype)
    chosen = choose_backend("delta_rule", q, backend, mode, chunk_size)
    if chosen == "fla":
        return fla_delta_rule(q, k, v, beta, scale=scale, S0=S0,
                              output_final_state=output_final_state)
    if chosen == "triton":  # see linear_attn
        o, S = triton_kernels().delta_rule_triton(q * scale if scale != 1.0 else q, k, v, beta,
                                                  S0, min(chunk_size, T))
        return o.to(q.dtype), (S if output_final_state else None)
    args = {"q": q.to(cdtype) if scale == 1.0 else q.to(cdtype) * scale, "k": k.to(cdtype), "v": v.to(cdtype),
            "beta": beta.to(cdtype)}
    if mode == "chunk" and T > 1:
        o, S = delta_rule_chunk(**args, S=S0, chunk_size=min(chunk_size, T),
                                products=products_dtype(cdtype))
    elif mode == "naive":
        o, S = delta_rule_naive(**args, S0=S0)
    else:  # mode="recurrent", or a decoding step of mode="chunk" (see linear_attn)
        o, S = delta_rule_recurrent(**args, S=S0)
    return o.to(q.dtype), (S if output_final_state else None)
