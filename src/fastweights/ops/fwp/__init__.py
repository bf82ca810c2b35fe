"""Fast weight programmers: linear attention (sum rule) and the delta rule (DeltaNet).

SPEC.md 1.3 (sum rule, with/without attention normalisation) and 1.4 (delta rule, read after
write). Public functions validate their arguments, upcast to float32 (float64 stays float64),
dispatch on ``mode`` and return outputs in the input dtype with float32-or-wider states.
On CUDA, mode="chunk" runs fla's or this project's Triton kernels (``backend=``, chosen by
ops/backend.py); everywhere else, PyTorch.
"""

from __future__ import annotations

import torch

from ..._checks import (
    check_bool,
    check_finite_float,
    check_mode,
    check_nonneg_float,
    check_positive_int,
    check_qkv,
    check_shape,
    check_state_tensor,
    check_tensor,
    matrix_state,
    state_dtype,
)
from .._autocast import float32_compute
from .._varlen import run_packed
from ..backend import choose_backend, fla_delta_rule, fla_linear_attn, triton_kernels
from .chunk import delta_rule_chunk, linear_attn_chunk
from .feature_maps import (
    FEATURE_MAPS,
    dpfp,
    draw_favor_projection,
    elu_plus_one,
    favor_features,
    feature_map,
    relu,
    sum_norm,
)
from .naive import delta_rule_naive, linear_attn_naive
from .recurrent import delta_rule_recurrent, linear_attn_recurrent

__all__ = [
    "FEATURE_MAPS",
    "delta_rule",
    "dpfp",
    "draw_favor_projection",
    "elu_plus_one",
    "favor_features",
    "feature_map",
    "linear_attn",
    "preferred_chunk_size",
    "relu",
    "sum_norm",
]

MODES = ("chunk", "recurrent", "naive")

# Chunk sizes measured per device kind (forward and forward+backward, B1 H8 T4096 D64 float32;
# `python -m fastweights.bench.fwp_forms --backward --chunk-sizes 16,32,64,128 --modes chunk`,
# recorded in benchmarks/results/chunk_sizes/). Devices not measured here keep 64, the size
# flash-linear-attention's GPU kernels use.
PREFERRED_CHUNK_SIZES: dict[str, dict[str, int]] = {
    "cpu": {"linear_attn": 64, "delta_rule": 32},
}


def preferred_chunk_size(op: str, device: torch.device | str) -> int:
    """The measured fastest ``chunk_size`` of ``op`` (``"linear_attn"`` or ``"delta_rule"``) on
    this kind of device (see ``PREFERRED_CHUNK_SIZES``); 64 where nothing was measured. Layers
    built with ``chunk_size=None`` use it; the ops themselves keep DESIGN's default of 64."""
    if op not in ("linear_attn", "delta_rule"):
        raise ValueError(f"op must be 'linear_attn' or 'delta_rule', got {op!r}")
    return PREFERRED_CHUNK_SIZES.get(torch.device(device).type, {}).get(op, 64)


@float32_compute
def linear_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, normalize: bool = False,
    eps: float = 1e-6, scale: float = 1.0,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None, backend: str | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Causal linear attention / sum-rule fast weights (SPEC 1.3).

    q, k: [B, T, H, Dk] (already feature-mapped); v: [B, T, H, Dv].
    State (S [B, H, Dk, Dv], z [B, H, Dk]): S_t = S_{t-1} + k_t^T v_t, z_t = z_{t-1} + k_t.
    o_t = (scale q_t) S_t, divided by ((scale q_t) . z_t + eps) when ``normalize``.
    Returns (o [B, T, H, Dv] in q's dtype, (S, z) in float32/float64 or None).
    ``cu_seqlens`` [N + 1]: packed documents in a batch of one, state reset at each boundary;
    initial/final states are then lists with one state per document (see ops/_varlen.py).
    ``backend``: "fla", "triton", "torch" or None (automatic); see ops/backend.py.
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    check_bool("normalize", normalize)
    check_nonneg_float("eps", eps)
    check_finite_float("scale", scale)
    check_bool("output_final_state", output_final_state)
    check_mode(mode, MODES)
    check_positive_int("chunk_size", chunk_size)
    if cu_seqlens is not None:
        return run_packed(linear_attn, (q, k, v), cu_seqlens, initial_state, output_final_state,
                          normalize=normalize, eps=eps, scale=scale, mode=mode, chunk_size=chunk_size,
                          backend=backend)
    cdtype = state_dtype(q.dtype)
    if initial_state is None:
        S0 = q.new_zeros(B, H, Dk, Dv, dtype=cdtype)
        z0 = q.new_zeros(B, H, Dk, dtype=cdtype)
    else:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise TypeError("initial_state must be a tuple (S [B, H, Dk, Dv], z [B, H, Dk]) or None")
        S0, z0 = initial_state
        check_state_tensor("initial_state[0] (S)", S0, (B, H, Dk, Dv), "[B, H, Dk, Dv]", q)
        check_state_tensor("initial_state[1] (z)", z0, (B, H, Dk), "[B, H, Dk]", q)
        S0, z0 = S0.to(cdtype), z0.to(cdtype)
    chosen = choose_backend("linear_attn", q, backend, mode, chunk_size)
    if chosen == "fla":
        return fla_linear_attn(q, k, v, normalize=normalize, eps=eps, scale=scale, S0=S0, z0=z0,
                               output_final_state=output_final_state)
    if chosen == "triton":
        # The kernels take the inputs in their own dtype and upcast on chip (states float32).
        o, S, z = triton_kernels().linear_attn_triton(q * scale if scale != 1.0 else q, k, v, S0, z0,
                                             normalize, eps, min(chunk_size, T))
        return o.to(q.dtype), ((S, z) if output_final_state else None)
    qc, kc, vc = q.to(cdtype) * scale, k.to(cdtype), v.to(cdtype)
    if mode == "chunk" and T == 1:
        # A decoding step: one token of the recurrence is the same arithmetic without padding
        # the token to a whole chunk.
        o, S, z = linear_attn_recurrent(qc, kc, vc, S0, z0, normalize, eps)
    elif mode == "chunk":
        o, S, z = linear_attn_chunk(qc, kc, vc, S0, z0, normalize, eps, min(chunk_size, T))
    elif mode == "recurrent":
        o, S, z = linear_attn_recurrent(qc, kc, vc, S0, z0, normalize, eps)
    else:
        o, S, z = linear_attn_naive(qc, kc, vc, S0, z0, normalize, eps)
    return o.to(q.dtype), ((S, z) if output_final_state else None)


@float32_compute
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
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    check_tensor("beta", beta)
    check_shape("beta", beta, (B, T, H), "[B, T, H]")
    if beta.device != q.device:
        raise ValueError(f"beta is on device {beta.device} but q is on {q.device}; they must match")
    check_finite_float("scale", scale)
    check_bool("output_final_state", output_final_state)
    check_mode(mode, MODES)
    check_positive_int("chunk_size", chunk_size)
    if cu_seqlens is not None:
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
        o, S = triton_kernels().delta_rule_triton(q * scale if scale != 1.0 else q, k, v, beta, S0,
                                         min(chunk_size, T))
        return o.to(q.dtype), (S if output_final_state else None)
    qc, kc, vc, bc = q.to(cdtype) * scale, k.to(cdtype), v.to(cdtype), beta.to(cdtype)
    if mode == "chunk" and T == 1:  # a decoding step (see linear_attn)
        o, S = delta_rule_recurrent(qc, kc, vc, bc, S0)
    elif mode == "chunk":
        o, S = delta_rule_chunk(qc, kc, vc, bc, S0, min(chunk_size, T))
    elif mode == "recurrent":
        o, S = delta_rule_recurrent(qc, kc, vc, bc, S0)
    else:
        o, S = delta_rule_naive(qc, kc, vc, bc, S0)
    return o.to(q.dtype), (S if output_final_state else None)
