"""decay_linear_attn through flash-linear-attention's ``chunk_simple_gla`` (the ``"fla"``
backend, ops/backend.py chooses it): the per-head lambda is simple GLA's log-decay
g = log(lambda), broadcast over [B, T, H]; the other conventions are ops/linear_attn/fla.py's.
"""

from __future__ import annotations

import torch

from .. import backend

backend.register_fla("simple_gla", "fla.ops.simple_gla", "chunk_simple_gla")


def fla_decay_linear_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, *, scale: float,
    S0: torch.Tensor, output_final_state: bool, cu_seqlens: torch.Tensor | None = None,
    bounds: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """decay_linear_attn through fla's ``chunk_simple_gla``: g = log(lambda_h) per token (states
    as in ``fla_linear_attn``)."""
    B, T, H = q.shape[:3]
    g = torch.log(decay.to(torch.float32)).view(1, 1, H).expand(B, T, H).contiguous()
    o, S = backend.fla_ops().simple_gla(q, k, v, g=g, scale=scale, initial_state=S0,
                                output_final_state=output_final_state,
                                **backend.fla_varlen(cu_seqlens, bounds))
    return o, (S.to(torch.float32) if output_final_state else None)
