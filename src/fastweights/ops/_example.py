"""What an op's ``examples.py`` returns (``fastweights.ops.examples``): one call of the op with
inputs as its layers make them, for the benchmarks and the tests that need a realistic call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch


class Example(NamedTuple):
    """One call of an op: ``qkv`` its operands (what a benchmark casts to the dtype it measures),
    ``gates`` its per-token gates ([B, T, H], float32 as the layers pass them), ``consts`` the
    positional inputs after them (a decay, a gate, a bias table), ``state`` its initial state
    (None: none) and ``options`` its keyword arguments."""

    qkv: tuple[torch.Tensor, ...]
    gates: tuple[torch.Tensor, ...]
    consts: tuple[torch.Tensor, ...]
    state: Any
    options: dict[str, Any]

    def call(self, op: Callable[..., Any], **kwargs: Any) -> Any:
        """``op`` on this example (``kwargs`` added to the options)."""
        initial = {} if self.state is None else {"initial_state": self.state}
        return op(*self.qkv, *self.gates, *self.consts, **initial, **self.options, **kwargs)


class Draw:
    """Random tensors for an example: float32 on ``device`` from ``generator``'s stream."""

    def __init__(self, device: torch.device | str, generator: torch.Generator | None) -> None:
        self.device, self.generator = torch.device(device), generator

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, generator=self.generator)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, device=self.device, generator=self.generator)
