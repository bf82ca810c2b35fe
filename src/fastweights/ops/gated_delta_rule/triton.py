"""The gated delta rule (docs/maths.md 5b) in the delta rule's Triton forward kernels with the
gates on (``HAS_G``, ops/delta_rule/triton.py), in the algebra of ops/delta_rule/chunk.py's
``delta_rule_chunk`` with gates; its backward is the PyTorch chunked form's. Imports ``triton``
at import time.
"""

from __future__ import annotations

import torch

from ..delta_rule.chunk import delta_rule_chunk
from ..delta_rule.triton import (
    _forward,
    _launch,
    _prepare,
    _state_forward,
    _ut_forward,
    supports,
)

__all__ = ["gated_delta_rule_triton", "supports"]


class _GatedDeltaTriton(torch.autograd.Function):
    """(o, S) = the chunked gated delta rule, forward in the kernels (a), (b), (c) with the gates
    on (HAS_G); backward by PyTorch: the chunked form of ops/delta_rule/chunk.py (with gates) is
    recomputed from the saved inputs in float32 and differentiated by its hand-written backward
    (no Triton backward kernels for the gates yet). S0 [B*H, Dk, Dv] float32."""

    @staticmethod
    def forward(ctx, q, k, v, beta, g, S0, chunk_size):  # type: ignore[override]
        L = _launch(q, v, chunk_size, "gated_delta_rule")
        W, U0, _, last = _ut_forward(L, k, v, beta, store_x=False, g=g)
        h, U, S = _state_forward(L, k, W, U0, S0, g=g, last=last)
        o = _forward(L, q, k, U, h, q.dtype, g=g)
        ctx.save_for_backward(q, k, v, beta, g, S0)
        ctx.chunk_size = chunk_size
        return o, S

    @staticmethod
    def backward(ctx, do, dS):  # type: ignore[override]
        saved = ctx.saved_tensors
        B, _, H, Dv = saved[2].shape
        Dk = saved[0].shape[-1]
        with torch.enable_grad():
            xs = [x.detach().to(torch.float32).requires_grad_() for x in saved]
            o, S = delta_rule_chunk(*xs[:4], S=xs[5].reshape(B, H, Dk, Dv),
                                    chunk_size=ctx.chunk_size, g=xs[4])
            outs = [(o, do), (S.reshape(B * H, Dk, Dv), dS)]
            outs = [(t, d) for t, d in outs if d is not None]
            grads = torch.autograd.grad([t for t, _ in outs], xs, [d for _, d in outs],
                                        allow_unused=True)
        grads = [None if gr is None else gr.to(x.dtype) for gr, x in zip(grads, saved)]
        return (*grads, None)


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
    Differentiable: the backward is the PyTorch chunked form's (``_GatedDeltaTriton``)."""
    B, _, H, Dv = v.shape
    Dk = q.shape[-1]
    q, k, v = _prepare(q, k, v)
    beta, g = (x.to(torch.float32).contiguous() for x in (beta, g))
    o, S = _GatedDeltaTriton.apply(q, k, v, beta, g,
                                   S0.to(torch.float32).reshape(B * H, Dk, Dv).contiguous(),
                                   chunk_size)
    return o, S.reshape(B, H, Dk, Dv)
