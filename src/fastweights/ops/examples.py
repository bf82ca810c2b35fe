"""Every op's example call, declared once in its folder (``<folder>/examples.py``) and read by
the benchmarks (bench/targets.py, bench/gpu.py) and the tests: ``example_inputs(op, B, T, H, D)``
is an ``Example`` with inputs as the op's layers make them (docs/design.md, "Floors")."""

from __future__ import annotations

import torch

from ._example import Draw, Example
from .aft.examples import EXAMPLES as _AFT
from .delta_rule.examples import EXAMPLES as _DELTA
from .gated_delta_rule.examples import EXAMPLES as _GATED
from .infini.examples import EXAMPLES as _INFINI
from .linear_attn.examples import EXAMPLES as _LINEAR
from .softmax.examples import EXAMPLES as _SOFTMAX
from .transnormer.examples import EXAMPLES as _TRANSNORMER
from .ttt.examples import EXAMPLES as _TTT

__all__ = ["EXAMPLE_OPS", "Example", "example_inputs"]

_EXAMPLES = {**_LINEAR, **_DELTA, **_GATED, **_TRANSNORMER, **_SOFTMAX, **_INFINI, **_TTT, **_AFT}
EXAMPLE_OPS = tuple(_EXAMPLES)  # the ops with an example: every op of fastweights.ops


def example_inputs(op: str, B: int, T: int, H: int, D: int, *,
                   device: torch.device | str = "cpu", seed: int | None = 0) -> Example:
    """The example call of ``op`` (a name of ``EXAMPLE_OPS``) for batch B, T tokens, H heads of
    size D (AFT: C = H D channels), float32 on ``device``, drawn from a generator seeded by
    ``seed`` (None: the global one)."""
    if op not in _EXAMPLES:
        raise ValueError(f"op must be one of {', '.join(EXAMPLE_OPS)}, got {op!r}")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    return _EXAMPLES[op](B, T, H, D, Draw(device, generator))
