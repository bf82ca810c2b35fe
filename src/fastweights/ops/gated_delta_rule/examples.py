"""``gated_delta_rule``'s example call (``fastweights.ops.examples``), as Gated DeltaNet makes
it: L2-normalised queries and keys, write strengths in (0, 1), log-decays near 0 (decays near
1), 1/sqrt(D) scaling, a carried state."""

from __future__ import annotations

import torch.nn.functional as F

from .._example import Draw, Example


def gated_delta_rule_example(B: int, T: int, H: int, D: int, draw: Draw) -> Example:
    q, k = (F.normalize(draw.randn(B, T, H, D), dim=-1) for _ in range(2))
    gates = (draw.rand(B, T, H), F.logsigmoid(3 + draw.randn(B, T, H)))  # beta, g
    return Example((q, k, draw.randn(B, T, H, D)), gates, (), 0.1 * draw.randn(B, H, D, D),
                   {"scale": D ** -0.5})


EXAMPLES = {"gated_delta_rule": gated_delta_rule_example}
