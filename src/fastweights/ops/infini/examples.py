"""``infini_attention``'s example call (``fastweights.ops.examples``): segments of 512 tokens,
a per-head gate, no carried state (the layer starts from an empty memory)."""

from __future__ import annotations

from .._example import Draw, Example


def infini_attention_example(B: int, T: int, H: int, D: int, draw: Draw) -> Example:
    return Example(tuple(draw.randn(B, T, H, D) for _ in range(3)), (), (draw.randn(H),), None,
                   {"segment_len": 512})


EXAMPLES = {"infini_attention": infini_attention_example}
