"""The gated delta rule (docs/maths.md 5b) in the delta rule's Triton kernels with the gates on
(``HAS_G``, ops/delta_rule/triton.py), forward and backward, in the algebra of
ops/delta_rule/chunk.py's ``delta_rule_chunk`` with gates and its backward. Imports ``triton``
at import time.
"""

from __future__ import annotations

import torch

from ..delta_rule.triton import (
    _backward,
    _forward,
    _launch,
    _prepare,
    _state_forward,
    _unpad,
    _ut_forward,
    supports,
)

__all__ = ["gated_delta_rule_triton", "supports"]


class _GatedDeltaTriton(torch.autograd.Function):
    """(o, S) = the chunked gated delta rule, forward in the kernels (a), (b), (c) and backward
    in (d) to (g) with the gates on (HAS_G); the backward recomputes (a) and (b) from the saved
    inputs, as the delta rule's. S0 [B*H, Dk, Dv] float32."""

    @staticmethod
    def forward(ctx, q, k, v, beta, g, S0, chunk_size):  # type: ignore[override]
        L = _launch(q, v, chunk_size, "gated_delta_rule")
        W, U0, _, last = _ut_forward(L, k, v, beta, store_x=False, g=g)
        h, U, S = _state_forward(L, k, W, U0, S0, g=g, last=last)
        o = _forward(L, q, k, U, h, q.dtype, g=g)
        ctx.save_for_backward(q, k, v, beta, g, S0)
        ctx.L = L
        return o, S

    @staticmethod
    def backward(ctx, do, dS):  # type: ignore[override]
        q, k, v, beta, g, S0 = ctx.saved_tensors
        L = ctx.L
        if do is None:
            do = torch.zeros(*v.shape[:3], L.Dv, dtype=q.dtype, device=q.device)
        W, U0, X, last = _ut_forward(L, k, v, beta, store_x=True, g=g)
        h, U, _ = _state_forward(L, k, W, U0, S0, g=g, last=last)
        dq, dk, dv, dbeta, dS0, dg = _backward(L, q, k, v, beta, X, W, U, h, do, dS, g=g,
                                               last=last)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbeta.to(beta.dtype),
                dg.to(g.dtype), dS0, None)


def gated_delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    S0: torch.Tensor, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule (docs/maths.md 5b; the WY/UT form with the decay folded in as
    segment sums of the log-gates, ops/delta_rule/chunk.py) in the delta rule's kernels with the
    gates on; see ``delta_rule_chunk``.

    q (scaled), k [B, T, Hk, Dk], v [B, T, H, Dv] (H a multiple of Hk: value head h reads key
    head h // (H / Hk)) in float16/bfloat16/float32; beta, g (log-decays <= 0, -inf a reset)
    [B, T, H] in any floating dtype (read as float32); S0 [B, H, Dk, Dv] float32;
    chunk_size <= 64, Dk <= 128. Returns (o [B, T, H, Dv] in q's dtype, S float32).
    Differentiable in every input: the backward runs the kernels too (``_GatedDeltaTriton``)."""
    (q, k, v, beta, g), S0, dims = _prepare(q, k, v, S0, beta, g)
    o, S = _GatedDeltaTriton.apply(q, k, v, beta, g, S0, chunk_size)
    return _unpad(o, S, dims)
