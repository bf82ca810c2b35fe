"""``float32_compute``: the decorator every public op wears so autocast cannot reach inside it.

Ops upcast their inputs to float32 (float64 stays float64) and keep recurrent states and
normalisers in that dtype (DESIGN.md; SPEC 1.6: "do state accumulation in fp32 even under bf16
autocast"). Under ``torch.autocast`` every matmul inside an op would silently run in bfloat16
again, whatever dtype the op cast its operands to: states came back in bfloat16 and AFT/decay
outputs differed from the float32 result by O(1). Autocast is therefore switched off for the
op's own device while it runs; the op still returns its output in the input dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def float32_compute(fn: F) -> F:
    """Run ``fn`` with autocast disabled on the device of its first tensor argument."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or not torch.is_autocast_enabled(first.device.type):
            return fn(*args, **kwargs)  # validation reports a non-tensor; nothing to switch off
        with torch.autocast(first.device.type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
