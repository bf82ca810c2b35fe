"""AFT's example calls (``fastweights.ops.examples``), on C = H D channels as the layers make
them: keys of unit scale, small position biases (the layers start near AFT-simple), AFT-local's
window and AFT-conv's kernel of 64, no carried state; ``aft`` is AFT-full (a bias table of the
call's tokens)."""

from __future__ import annotations

from .._example import Draw, Example


def aft_example(B: int, T: int, H: int, D: int, draw: Draw) -> Example:
    C = H * D
    return Example(tuple(draw.randn(B, T, C) for _ in range(3)), (), (0.01 * draw.randn(T, T),),
                   None, {})


def aft_local_example(B: int, T: int, H: int, D: int, draw: Draw) -> Example:
    C = H * D
    return Example(tuple(draw.randn(B, T, C) for _ in range(3)), (), (0.01 * draw.randn(T, 64),),
                   None, {"window": 64})


def aft_conv_example(B: int, T: int, H: int, D: int, draw: Draw) -> Example:
    qkv = (draw.randn(B, T, H, D), draw.randn(B, T, H), draw.randn(B, T, H, D))
    return Example(qkv, (), (0.01 * draw.randn(H, 64),), None, {})


EXAMPLES = {"aft": aft_example, "aft_local": aft_local_example, "aft_conv": aft_conv_example}
