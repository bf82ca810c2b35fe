"""``linear_attn``'s example call (``fastweights.ops.examples``): ELU+1 queries and keys, the
attention normaliser on, 1/sqrt(D) scaling, a carried state."""

from __future__ import annotations

import torch.nn.functional as F

from .._example import Draw, Example
from .._state import LinearAttnState


def linear_attn_example(B: int, T: int, H: int, D: int, draw: Draw) -> Example:
    q, k = (F.elu(draw.randn(B, T, H, D)) + 1 for _ in range(2))
    state = LinearAttnState(0.1 * draw.randn(B, H, D, D), draw.rand(B, H, D))
    return Example((q, k, draw.randn(B, T, H, D)), (), (), state,
                   {"normalize": True, "scale": D ** -0.5})


EXAMPLES = {"linear_attn": linear_attn_example}
