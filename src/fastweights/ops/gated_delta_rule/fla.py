"""gated_delta_rule through flash-linear-attention's ``chunk_gated_delta_rule`` (the ``"fla"``
backend, ops/backend.py chooses it). Arguments arrive checked by the public op; the conventions are
ops/linear_attn/fla.py's and ops/delta_rule/fla.py's, and: ``chunk_gated_delta_rule(q, k, v, g,
beta, ...)`` takes g before beta (ours: beta, g) and the same log-decay g (fla's kernels take
cumulative sums of it per chunk); g goes in float32 (as fla's own GatedDeltaNet layer computes it),
beta in q's dtype as for the delta rule; ``use_qk_l2norm_in_kernel``,
``use_beta_sigmoid_in_kernel`` and ``allow_neg_eigval`` stay False (our layer normalises q, k and
makes beta itself, in [0, 2) with allow_neg_eigval); grouped heads (v, beta, g with H = a multiple
of Hk heads) map as they are: fla's value head i_hv reads key head i_hv // (H / Hk), as ours; the
state is fla's default K-first [B, H, Dk, Dv] (``state_v_first`` False).
"""

from __future__ import annotations

import torch

from .. import backend

backend.register_fla("gated_delta_rule", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule")


def fla_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, *,
    scale: float, S0: torch.Tensor, output_final_state: bool,
    cu_seqlens: torch.Tensor | None = None, bounds: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gated_delta_rule through fla's ``chunk_gated_delta_rule`` (see the module docstring):
    q, k [B, T, Hk, Dk], v [B, T, H, Dv], beta, g [B, T, H]; states [B, H, Dk, Dv] float32
    ([N, H, Dk, Dv] for a packed batch, as in ``fla_linear_attn``)."""
    o, S = backend.fla_ops().gated_delta_rule(
        q, k, v, g.to(torch.float32), beta.to(q.dtype), scale=scale, initial_state=S0,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
        **backend.fla_varlen(cu_seqlens, bounds))
    return o, (S.to(torch.float32) if output_final_state else None)
