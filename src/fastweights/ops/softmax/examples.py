"""``softmax_attention``'s example call (``fastweights.ops.examples``): causal, no state."""

from __future__ import annotations

from .._example import Draw, Example


def softmax_attention_example(B: int, T: int, H: int, D: int, draw: Draw) -> Example:
    return Example(tuple(draw.randn(B, T, H, D) for _ in range(3)), (), (), None, {})


EXAMPLES = {"softmax_attention": softmax_attention_example}
