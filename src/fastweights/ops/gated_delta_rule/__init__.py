"""The gated delta rule (Gated DeltaNet, docs/maths.md 5b): ``gated_delta_rule``. Its state is the
single matrix S [B, H, Dk, Dv], a plain tensor (``o, S = gated_delta_rule(...)``), as the delta
rule's.

The forms: ``naive.py`` (the oracle), ``recurrent.py`` (token by token, and the one-token step
that ``gated_delta_rule_step`` runs), and the delta rule's chunked WY/UT form with its hand-written
backward, gates on (ops/delta_rule/chunk.py, ``delta_rule_chunk`` with ``g``); on CUDA fla's
kernels (``fla.py``) or this project's (``triton.py``).

Dimension legend: B batch, T time, Hk query/key heads, H value heads (a multiple of Hk), Dk
key/query dim, Dv value dim.
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
    check_same_dtype_device,
    check_tensor,
    matrix_state,
    state_dtype,
)
from .._autocast import float32_compute
from .._modes import RECURRENT_MODES, reads_allowed
from .._pieces import in_pieces, piece_length
from .._steps import wide
from .._varlen import run_packed, stack_packed_states
from ..backend import Kernel, Trial, choose_backend, optional_module, register
from ..delta_rule.chunk import delta_rule_chunk
from .fla import fla_gated_delta_rule
from .naive import gated_delta_rule_naive
from .recurrent import gated_delta_rule_recurrent, token_step
from .speeds import SPEEDS

MODES = RECURRENT_MODES
def _triton() -> ModuleType:
    from . import triton

    return triton


triton_kernels = optional_module(_triton)  # this op's triton.py; None without triton


def check_grouped_qkv(q: object, k: object, v: object) -> tuple[int, int, int, int, int, int]:
    """q, k ``[B, T, Hk, Dk]`` and v ``[B, T, H, Dv]`` with H a multiple of Hk: floating point,
    one dtype and device. Returns (B, T, Hk, H, Dk, Dv)."""
    check_tensor("q", q, 4, "[B, T, Hk, Dk]")
    check_tensor("k", k, 4, "[B, T, Hk, Dk]")
    check_tensor("v", v, 4, "[B, T, H, Dv]")
    if k.shape != q.shape:
        raise ValueError(
            f"k must have the same shape as q [B, T, Hk, Dk] = {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    B, T, Hk, Dk = q.shape
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"v must have shape [B, T, H, Dv] with B, T = {tuple(q.shape[:2])} as in q, "
            f"got {tuple(v.shape)}"
        )
    H, Dv = v.shape[2:]
    if min(B, T, Hk, Dk, H, Dv) < 1:
        raise ValueError(f"q, k, v must have non-empty dims, got q {tuple(q.shape)}, v {tuple(v.shape)}")
    if H % Hk:
        raise ValueError(
            f"v must have a number of heads H that is a multiple of q's and k's Hk = {Hk} (each "
            f"key head serves H / Hk value heads), got v {tuple(v.shape)}"
        )
    check_same_dtype_device(q=q, k=k, v=v)
    return B, T, Hk, H, Dk, Dv


def check_log_decay(g: torch.Tensor) -> None:
    """Every gate g <= 0 (-inf allowed: a decay of 0, a hard reset); NaN and g > 0 refused.

    A check of values is a data-dependent branch: torch.compile(fullgraph=True) and
    torch.export cannot trace it, so traced programs skip it (as decay_linear_attn's)."""
    if not reads_allowed():
        return
    if bool((g <= 0).all()):  # NaN fails the comparison too
        return
    first = tuple(int(i) for i in (~(g <= 0)).nonzero()[0])
    raise ValueError(
        f"g must be <= 0 everywhere (the log of a decay in [0, 1]; -inf is a full reset), "
        f"got g{list(first)} = {g[first].item()}"
    )


# Chunks of 32 measured fastest on the CPU (benchmarks/results/gated_delta_epyc_avx2/).
register("gated_delta_rule", fla=Kernel(), triton=Kernel(kernels=triton_kernels),
         chunk_sizes={"cpu": 32}, speeds=SPEEDS)


@float32_compute
def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, *,
    scale: float = 1.0, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule, read after write (docs/maths.md 5b; Yang, Kautz, Hatamizadeh 2024).

    q, k: [B, T, Hk, Dk] (the caller normalises them: L2 in Gated DeltaNet); v: [B, T, H, Dv];
    beta (write strengths), g (log-decays): [B, T, H]. With alpha_t = exp(g_t),
    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T and o_t = S_t^T (scale q_t)
    (column vectors; state S [B, H, Dk, Dv]). g = 0 is the delta rule (``delta_rule``).
    Returns (o [B, T, H, Dv] in q's dtype, S in float32/float64 or None).

    g is the log of the decay, the convention of flash-linear-attention and transformers
    (Gated DeltaNet's layer makes it -exp(A_log) softplus(a + dt_bias)). It must be <= 0
    everywhere: -inf is allowed (alpha = 0, a hard reset: nothing before the token survives it),
    NaN and g > 0 (a growing state, which the chunked form's decay tables would overflow on)
    are a ValueError before any computation, except inside torch.compile, which cannot trace
    the check. beta is not range-checked (Gated DeltaNet's allow_neg_eigval takes beta in
    [0, 2)). beta and g may have any floating dtype: like the state they are used in the
    compute dtype.

    Grouped heads: v, beta and g have H heads, a multiple of q's and k's Hk; value head h reads
    key head h // (H / Hk), i.e. each key head serves H / Hk consecutive value heads, as
    transformers' Qwen3.5 and Qwen3-Next (``repeat_interleave`` of q and k on the head dim)
    and fla's GatedDeltaNet kernels (num_v_heads > num_heads: i_h = i_hv // (HV // H)) lay them
    out. The state has the H value heads. No hidden 1/sqrt(Dk): transformers'
    torch_chunk_gated_delta_rule(q, k, v, g, beta) is gated_delta_rule(q, k, v, beta, g,
    scale=Dk ** -0.5) (with use_qk_l2norm_in_kernel, on q and k L2-normalised as
    x / sqrt(sum x^2 + 1e-6)); tests/ops/test_gated_delta_transformers.py checks it.

    ``mode``: "chunk" (default; any chunk_size >= 1, T need not be a multiple; a one-token call
    runs the recurrent step, as a layer's decoding step does; a layer built with
    ``chunk_size=None`` takes the size measured fastest on its device kind, docs/performance.md),
    "recurrent" (token by token; ``gated_delta_rule_step`` is one token of it, what a
    layer's decoding step calls) or "naive" (the literal recurrence, the oracle). All three are
    differentiable in q, k, v, beta, g and the initial state; the chunked form has a
    hand-written backward. ``cu_seqlens`` [N + 1]: packed documents in a batch of one, the state
    reset at each boundary; initial/final states are then lists with one state per document
    (ops/_varlen.py).

    ``backend`` (ops/backend.py, as for delta_rule): "fla" (flash-linear-attention's
    ``chunk_gated_delta_rule``, CUDA, mode="chunk" with chunk_size=64, float16/bfloat16/float32
    inputs; packed batches go to it whole), "triton" (triton.py, CUDA, mode="chunk",
    chunk_size <= 64, Dk <= 128, float16/bfloat16 inputs, forward and backward; packed batches
    one document at a time), "torch" (the forms above, any device), or None: the environment
    variable ``FASTWEIGHTS_BACKEND``, else fla, triton, torch, the first that can run the call
    (fla and triton ranked by their measured times where both were measured, ``speeds.py``).
    One-token calls stay on torch's step.

    Precision: float32 for float32, bfloat16 and float16 inputs (float64 stays float64),
    autocast switched off inside; the state is float32 or float64 whatever the input dtype.
    """
    B, T, _, H, Dk, Dv = check_grouped_qkv(q, k, v)
    check_arg("beta", beta, (B, T, H), "[B, T, H]", q)
    check_arg("g", g, (B, T, H), "[B, T, H]", q)
    check_log_decay(g)
    check_finite_float("scale", scale)
    check_bool("output_final_state", output_final_state)
    check_mode(mode, MODES)
    check_positive_int("chunk_size", chunk_size)
    chosen = choose_backend("gated_delta_rule", q, backend, mode, chunk_size,
                            Trial(gated_delta_rule, (q, k, v, beta, g), scale=scale,
                                  chunk_size=chunk_size))
    if cu_seqlens is not None:
        if chosen == "fla":  # the whole packed batch, with fla's own cu_seqlens
            bounds, (S0,) = stack_packed_states(
                initial_state, cu_seqlens, q,
                lambda st: (matrix_state(st, (1, H, Dk, Dv), q, state_dtype(q.dtype)),))
            o, S = fla_gated_delta_rule(q, k, v, beta, g, scale=scale, S0=S0,
                                        output_final_state=output_final_state,
                                        cu_seqlens=cu_seqlens, bounds=bounds)
            return o, (list(S.split(1)) if output_final_state else None)
        return run_packed(gated_delta_rule, (q, k, v, beta, g), cu_seqlens, initial_state,
                          output_final_state, scale=scale, mode=mode, chunk_size=chunk_size,
                          backend=chosen)
    cdtype = state_dtype(q.dtype)
    S0 = matrix_state(initial_state, (B, H, Dk, Dv), q, cdtype)
    if chosen == "fla":
        return fla_gated_delta_rule(q, k, v, beta, g, scale=scale, S0=S0,
                                    output_final_state=output_final_state)
    if chosen == "triton":  # inputs in their own dtype, q scaled (see delta_rule)
        o, S = triton_kernels().gated_delta_rule_triton(q * scale if scale != 1.0 else q, k, v,
                                                        beta, g, S0, min(chunk_size, T))
        return o.to(q.dtype), (S if output_final_state else None)
    def wide(x: torch.Tensor) -> torch.Tensor:  # (a decoding step is short: skip no-op casts)
        return x if x.dtype == cdtype else x.to(cdtype)

    args = {"q": wide(q) if scale == 1.0 else wide(q) * scale, "k": wide(k), "v": wide(v),
            "beta": wide(beta), "g": wide(g)}
    if mode == "chunk" and T > 1:
        C = min(chunk_size, T)

        def run(q, k, v, beta, g, S):  # long CPU calls go in pieces of whole chunks (_pieces.py)
            return delta_rule_chunk(q=q, k=k, v=v, beta=beta, S=S, chunk_size=min(C, q.shape[1]), g=g)

        o, S = in_pieces(run, [args[n] for n in ("q", "k", "v", "beta", "g")], S0,
                         piece_length(args["v"], max(Dk, Dv), C))
    elif mode == "naive":
        o, S = gated_delta_rule_naive(**args, S0=S0)
    elif T == 1:  # a decoding step, of mode="chunk" or "recurrent" (see linear_attn)
        o, S = token_step(**args, S=S0)
    else:
        o, S = gated_delta_rule_recurrent(**args, S=S0)
    return o.to(q.dtype), (S if output_final_state else None)


@float32_compute
def gated_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, *,
    state: torch.Tensor | None = None, scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of ``gated_delta_rule`` (docs/maths.md 5b): q, k [B, 1, Hk, Dk], v
    [B, 1, H, Dv], beta, g [B, 1, H], ``state`` S [B, H, Dk, Dv] (None: zeros). Returns
    (o [B, 1, H, Dv] in q's dtype, S after the token). Shapes are checked, not g's values (a
    decoding step reads nothing back to the host; see ``linear_attn_step``)."""
    B, T, _, H, Dk, Dv = check_grouped_qkv(q, k, v)
    if T != 1:
        raise ValueError(f"a step takes one token: q must have shape [B, 1, Hk, Dk], got "
                         f"{tuple(q.shape)} (gated_delta_rule takes T tokens)")
    check_arg("beta", beta, (B, 1, H), "[B, 1, H]", q)
    check_arg("g", g, (B, 1, H), "[B, 1, H]", q)
    cdtype = state_dtype(q.dtype)
    S = matrix_state(state, (B, H, Dk, Dv), q, cdtype, "state")
    qc = wide(q, cdtype) if scale == 1.0 else wide(q, cdtype) * scale
    o, S = token_step(qc, wide(k, cdtype), wide(v, cdtype), wide(beta, cdtype), wide(g, cdtype), S)
    return (o if o.dtype == q.dtype else o.to(q.dtype)), S
