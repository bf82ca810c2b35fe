"""TransNormer's example calls (``fastweights.ops.examples``): ``decay_linear_attn`` with
1+ELU queries and keys scaled by 1/D and TransNormerLLM's range of decays, a carried state;
``block_attention`` with blocks of 64."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._example import Draw, Example


def decay_linear_attn_example(B: int, T: int, H: int, D: int, draw: Draw) -> Example:
    q, k = ((F.elu(draw.randn(B, T, H, D)) + 1) / D for _ in range(2))
    decay = torch.linspace(0.9, 0.999, H, device=draw.device)  # TransNormer's range
    return Example((q, k, draw.randn(B, T, H, D)), (), (decay,), 0.1 * draw.randn(B, H, D, D),
                   {"scale": D ** -0.5})


def block_attention_example(B: int, T: int, H: int, D: int, draw: Draw) -> Example:
    return Example(tuple(draw.randn(B, T, H, D) for _ in range(3)), (), (), None,
                   {"block_size": 64})


EXAMPLES = {"decay_linear_attn": decay_linear_attn_example,
            "block_attention": block_attention_example}
