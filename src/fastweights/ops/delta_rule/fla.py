"""delta_rule through flash-linear-attention's ``chunk_delta_rule`` (the ``"fla"`` backend,
ops/backend.py chooses it). Arguments arrive checked by the public op; the conventions are
ops/linear_attn/fla.py's, and: fla's ``use_qk_l2norm_in_kernel`` stays False: our callers normalise
keys (sum_norm or L2) themselves and the op uses k as given; beta is passed in q's dtype (fla's
kernels read beta like q), so a float32 beta driving bfloat16 q, k, v is rounded to bfloat16 there,
unlike the torch and triton backends.
"""

from __future__ import annotations

import torch

from .. import backend

backend.register_fla("delta_rule", "fla.ops.delta_rule", "chunk_delta_rule")


def fla_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, scale: float,
    S0: torch.Tensor, output_final_state: bool, cu_seqlens: torch.Tensor | None = None,
    bounds: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """delta_rule through fla's ``chunk_delta_rule`` with the keys as given (states as in
    ``fla_linear_attn``)."""
    o, S = backend.fla_ops().delta_rule(q, k, v, beta.to(q.dtype), scale=scale, initial_state=S0,
                                output_final_state=output_final_state,
                                use_qk_l2norm_in_kernel=False, **backend.fla_varlen(cu_seqlens, bounds))
    return o, (S.to(torch.float32) if output_final_state else None)
