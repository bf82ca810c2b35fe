"""TransNormer: block-diagonal attention (DiagAttention, SPEC.md 3.2), decayed linear attention
(TransNormerLLM / Lightning Attention, SPEC.md 3.5) and SRMSNorm (SPEC.md 3.1).

NormAttention's un-decayed core is ``fastweights.ops.linear_attn(..., normalize=False)``.
Public functions validate their arguments, compute in float32 (float64 stays float64) and return
outputs in the input dtype with float32-or-wider states.
"""

from __future__ import annotations

import math

import torch

from ..._checks import (
    check_bool,
    check_choice,
    check_finite_float,
    check_mode,
    check_positive_int,
    check_qkv,
    check_shape,
    check_tensor,
    matrix_state,
    state_dtype,
)
from .._autocast import float32_compute
from .._varlen import run_packed
from ..backend import choose_backend, fla_decay_linear_attn
from .chunk import block_attention_chunk, decay_linear_attn_chunk
from .naive import decay_linear_attn_naive
from .norm import srms_norm
from .recurrent import decay_linear_attn_recurrent

__all__ = ["block_attention", "decay_linear_attn", "srms_norm"]

MODES = ("chunk", "recurrent", "naive")
KERNELS = ("softmax", "relu")


@float32_compute
def decay_linear_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, *, scale: float = 1.0,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    mode: str = "chunk", chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal linear attention with a per-head decay, no denominator (SPEC 3.5).

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
    check_shape("decay", decay, (H,), "[H]")
    if decay.device != q.device:
        raise ValueError(f"decay is on device {decay.device} but q is on {q.device}; they must match")
    with torch.no_grad():
        ok = bool(((decay > 0) & (decay <= 1)).all())
    if not ok:
        raise ValueError(
            f"decay must lie in (0, 1] for every head, got values {decay.detach().cpu().tolist()}"
        )
    check_finite_float("scale", scale)
    check_bool("output_final_state", output_final_state)
    check_mode(mode, MODES)
    check_positive_int("chunk_size", chunk_size)
    if cu_seqlens is not None:
        return run_packed(decay_linear_attn, (q, k, v), cu_seqlens, initial_state,
                          output_final_state, decay=decay, scale=scale, mode=mode,
                          chunk_size=chunk_size, backend=backend)
    cdtype = state_dtype(q.dtype)
    S0 = matrix_state(initial_state, (B, H, Dk, Dv), q, cdtype)
    if choose_backend("decay_linear_attn", q, backend, mode, chunk_size) == "fla":
        return fla_decay_linear_attn(q, k, v, decay, scale=scale, S0=S0,
                                     output_final_state=output_final_state)
    qc, kc, vc, lam = q.to(cdtype) * scale, k.to(cdtype), v.to(cdtype), decay.to(cdtype)
    if mode == "chunk":
        o, S = decay_linear_attn_chunk(qc, kc, vc, lam, S0, chunk_size)
    elif mode == "recurrent":
        o, S = decay_linear_attn_recurrent(qc, kc, vc, lam, S0)
    else:
        o, S = decay_linear_attn_naive(qc, kc, vc, lam, S0)
    return o.to(q.dtype), (S if output_final_state else None)


@float32_compute
def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int,
    scale: float | None = None, kernel: str = "softmax",
) -> torch.Tensor:
    """Causal attention inside non-overlapping blocks of ``block_size`` tokens (SPEC 3.2).

    q, k: [B, T, H, Dk]; v: [B, T, H, Dv] -> o [B, T, H, Dv] in q's dtype. Blocks start at
    t = 0; the last block may be shorter. logits = scale q k^T (scale defaults to 1/sqrt(Dk)),
    causal within the block, nothing crosses a block border. ``kernel="softmax"`` (TransNormer
    T2): softmax over the allowed keys. ``kernel="relu"`` (T1): O = relu(logits) V with the
    disallowed entries 0; the SRMSNorm that follows it in T1 is the layer's job.
    """
    check_qkv(q, k, v)
    check_positive_int("block_size", block_size)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    check_finite_float("scale", scale)
    check_choice("kernel", kernel, KERNELS)
    # scaled_dot_product_attention accumulates in float32 for half inputs and a softmax average
    # cannot overflow, so the softmax kernel keeps the input dtype (and the fused GPU kernels);
    # the ReLU kernel sums up to block_size unnormalised terms, so it is computed in float32.
    cdtype = q.dtype if kernel == "softmax" else state_dtype(q.dtype)
    qc, kc, vc = q.to(cdtype), k.to(cdtype), v.to(cdtype)
    return block_attention_chunk(qc, kc, vc, block_size, scale, kernel).to(q.dtype)
