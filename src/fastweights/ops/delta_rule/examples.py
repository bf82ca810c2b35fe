"""The delta rule's example calls (``fastweights.ops.examples``): sum-normalised ELU+1 queries
and keys, write strengths in (0, 1), 1/sqrt(D) scaling, a carried state (DeltaNet's); and the
attention-normalised delta rule's."""

from __future__ import annotations

import torch.nn.functional as F

from .._example import Draw, Example
from .._state import LinearAttnState
from ..feature_maps import sum_norm


def delta_rule_example(B: int, T: int, H: int, D: int, draw: Draw) -> Example:
    q, k = (sum_norm(F.elu(draw.randn(B, T, H, D)) + 1) for _ in range(2))
    return Example((q, k, draw.randn(B, T, H, D)), (draw.rand(B, T, H),), (),
                   0.1 * draw.randn(B, H, D, D), {"scale": D ** -0.5})


def delta_rule_attn_norm_example(B: int, T: int, H: int, D: int, draw: Draw) -> Example:
    """The fast weight paper's Table 3 ablation: ELU+1 features, the normaliser carried."""
    q, k = (F.elu(draw.randn(B, T, H, D)) + 1 for _ in range(2))
    state = LinearAttnState(0.1 * draw.randn(B, H, D, D), draw.rand(B, H, D))
    return Example((q, k, draw.randn(B, T, H, D)), (draw.rand(B, T, H),), (), state,
                   {"scale": D ** -0.5})


EXAMPLES = {"delta_rule": delta_rule_example,
            "delta_rule_attn_norm": delta_rule_attn_norm_example}
