"""The delta rule (DeltaNet), read after write (docs/maths.md 1.4): ``delta_rule``. Its state is the
single matrix S [B, H, Dk, Dv], a plain tensor (``o, S = delta_rule(...)``). And the delta rule
with attention normalisation, ``delta_rule_attn_norm`` (the fast weight paper's Table 3
ablation), whose state is a ``LinearAttnState`` (S, z). The forms: ``naive.py`` (the
oracles), ``recurrent.py`` (token by token), ``chunk.py`` (the chunked WY/UT form, shared with
the gated delta rule); on CUDA fla's kernels (``fla.py``) or this project's (``triton.py``).

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim.
"""

from __future__ import annotations

from types import ModuleType

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
from .._modes import RECURRENT_MODES as MODES
from .._pieces import in_pieces, piece_length
from .._state import LinearAttnState
from .._steps import check_step_qkv, wide
from .._varlen import run_packed, stack_packed_states
from ..backend import Kernel, Trial, choose_backend, optional_module, register
from .chunk import delta_rule_chunk
from .fla import fla_delta_rule
from .naive import delta_rule_attn_norm_naive, delta_rule_naive
from .recurrent import delta_rule_recurrent
from .speeds import SPEEDS


def _triton() -> ModuleType:
    from . import triton

    return triton


triton_kernels = optional_module(_triton)  # this op's triton.py; None without triton

# fla 0.6's chunk_delta_rule refuses float32 inputs; the Triton kernels have no spill-free
# float32 tiling for it (triton.py tile_config): torch runs them. Chunks of 32 measured
# fastest on the CPU (docs/performance.md, "Chunk sizes").
register("delta_rule", fla=Kernel(dtypes=(torch.float16, torch.bfloat16),
                                  refused="fla's chunk_delta_rule refuses them (fla 0.6)"),
         triton=Kernel(kernels=triton_kernels), chunk_sizes={"cpu": 32}, speeds=SPEEDS)


@float32_states
def delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, scale: float = 1.0,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    mode: str = "chunk", chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delta-rule fast weights, read after write (docs/maths.md 1.4).

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
    chunks stay float32, as does the returned state (see chunk.py).
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    check_arg("beta", beta, (B, T, H), "[B, T, H]", q)
    check_finite_float("scale", scale)
    check_bool("output_final_state", output_final_state)
    check_mode(mode, MODES)
    check_positive_int("chunk_size", chunk_size)
    trial = Trial(delta_rule, (q, k, v, beta), scale=scale, chunk_size=chunk_size)
    if cu_seqlens is not None:
        if choose_backend("delta_rule", q, backend, mode, chunk_size, trial) == "fla":  # whole
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
    chosen = choose_backend("delta_rule", q, backend, mode, chunk_size, trial)
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
        C, products = min(chunk_size, T), products_dtype(cdtype)

        def run(q, k, v, beta, S):  # long CPU calls go in pieces of whole chunks (ops/_pieces.py)
            return delta_rule_chunk(q=q, k=k, v=v, beta=beta, S=S, chunk_size=min(C, q.shape[1]),
                                    products=products)

        o, S = in_pieces(run, [args[n] for n in ("q", "k", "v", "beta")], S0,
                         piece_length(args["q"], max(Dk, Dv), C))
    elif mode == "naive":
        o, S = delta_rule_naive(**args, S0=S0)
    else:  # mode="recurrent", or a decoding step of mode="chunk" (see linear_attn)
        o, S = delta_rule_recurrent(**args, S=S0)
    return o.to(q.dtype), (S if output_final_state else None)


@float32_states
def delta_rule_attn_norm(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, eps: float = 1e-6,
    scale: float = 1.0, initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64,
) -> tuple[torch.Tensor, LinearAttnState | None]:
    """The delta rule with attention normalisation (the fast weight paper's eqs. 26-27; lmtool's
    "Norm" variants, docs/maths.md 1.4), the ablation of the paper's Table 3.

    q, k: [B, T, H, Dk] non-negative features (feature-mapped, sum-normalised or not, by the
    caller); v: [B, T, H, Dv]; beta: [B, T, H]. With z_t = z_{t-1} + k_t:
    v_bar_t = k_t S_{t-1} / (k_t . z_{t-1}) (0 where k_t . z_{t-1} = 0: with non-negative
    features there is then nothing under k_t to erase), S_t = S_{t-1} + beta_t k_t^T (v_t - v_bar_t),
    o_t = (scale q_t) S_t / ((scale q_t) . z_t + eps). State: ``LinearAttnState`` (S, z).
    Returns (o [B, T, H, Dv] in q's dtype, (S, z) in float32/float64 or None).

    "recurrent" and "chunk" run ``delta_rule`` on rescaled inputs: with c_t = 1 / (k_t . z_{t-1})
    the update is S_t = (I - beta_t c_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t, which is the plain
    delta rule of k'_t = sqrt(c_t) k_t and v'_t = v_t / sqrt(c_t) (c_t = 1 where k_t . z_{t-1} =
    0, the erase term being 0 there); the read-out is divided by the normaliser afterwards.
    "naive" is the literal token loop. No packed documents (``cu_seqlens``).
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    check_arg("beta", beta, (B, T, H), "[B, T, H]", q)
    check_finite_float("scale", scale)
    check_finite_float("eps", eps)
    check_bool("output_final_state", output_final_state)
    check_mode(mode, MODES)
    check_positive_int("chunk_size", chunk_size)
    cdtype = state_dtype(q.dtype)
    if initial_state is None:
        S0, z0 = LinearAttnState.zeros(B, H, Dk, Dv, q)
    else:
        S0, z0 = LinearAttnState.check(initial_state, B, H, Dk, Dv, q)
    qc = q.to(cdtype) if scale == 1.0 else q.to(cdtype) * scale
    kc, vc, bc = k.to(cdtype), v.to(cdtype), beta.to(cdtype)
    if mode == "naive":
        o, S, z = delta_rule_attn_norm_naive(qc, kc, vc, bc, S0, z0, eps)
    else:
        z = z0.unsqueeze(1) + kc.cumsum(1)  # z_t [B, T, H, Dk]
        z_before = torch.cat([z0.unsqueeze(1), z[:, :-1]], dim=1)  # z_{t-1}
        den = (kc * z_before).sum(-1, keepdim=True)  # k_t . z_{t-1} [B, T, H, 1]
        # sqrt(c_t) = den^(-1/2); c_t = 1 where den = 0 (S_{t-1} has nothing under k_t to erase)
        root = torch.where(den > 0, den, torch.ones_like(den)).rsqrt()
        o, S = delta_rule(qc, kc * root, vc / root, bc, initial_state=S0, output_final_state=True,
                          mode=mode, chunk_size=chunk_size)
        o = o / ((qc * z).sum(-1, keepdim=True) + eps)
        z = z[:, -1]
    return o.to(q.dtype), (LinearAttnState(S, z) if output_final_state else None)


@float32_states
def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
    state: torch.Tensor | None = None, scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of ``delta_rule`` (docs/maths.md 1.4): q, k [B, 1, H, Dk], v [B, 1, H, Dv],
    beta [B, 1, H], ``state`` S [B, H, Dk, Dv] (None: zeros). Returns (o [B, 1, H, Dv] in q's
    dtype, S after the token). Shapes are checked, nothing else (see ``linear_attn_step``)."""
    B, H, Dk, Dv = check_step_qkv(q, k, v)
    check_arg("beta", beta, (B, 1, H), "[B, 1, H]", q)
    cdtype = state_dtype(q.dtype)
    S = matrix_state(state, (B, H, Dk, Dv), q, cdtype, "state")
    qc = wide(q, cdtype) if scale == 1.0 else wide(q, cdtype) * scale
    o, S = delta_rule_recurrent(qc, wide(k, cdtype), wide(v, cdtype), wide(beta, cdtype), S)
    return (o if o.dtype == q.dtype else o.to(q.dtype)), S
