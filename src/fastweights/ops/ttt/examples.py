"""TTT's example calls (``fastweights.ops.examples``), as the layers make them: keys and queries
of unit scale, inner learning rates eta = sigmoid(.) / D, a small learned initial model (batch
1, broadcast), the inner LayerNorm and the residual on, mini-batches of 16."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._example import Draw, Example


def _ttt_example(mlp: bool) -> Callable[[int, int, int, int, Draw], Example]:
    def example(B: int, T: int, H: int, D: int, draw: Draw) -> Example:
        q, k, v = (draw.randn(B, T, H, D) / D ** 0.5 for _ in range(3))
        eta = torch.sigmoid(draw.randn(B, T, H)) / D
        sizes = ((D, 4 * D), (4 * D,), (4 * D, D), (D,)) if mlp else ((D, D), (D,))
        state = tuple(0.02 * draw.randn(1, H, *size) for size in sizes)
        options = {"ln_weight": 1 + 0.1 * draw.randn(H, D), "ln_bias": 0.1 * draw.randn(H, D),
                   "residual": True, "mini_batch_size": 16}
        return Example((q, k, v), (eta,), (), state, options)
    return example


EXAMPLES = {"ttt_linear": _ttt_example(mlp=False), "ttt_mlp": _ttt_example(mlp=True)}
