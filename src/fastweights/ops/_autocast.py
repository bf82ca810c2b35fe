"""``float32_compute``: the decorator every public op wears so autocast cannot reach inside it,
and the CPU bfloat16 policy (``cpu_bf16_products``) of the two ops that opt into it.

Ops upcast their inputs to float32 (float64 stays float64) and keep recurrent states and
normalisers in that dtype (docs/design.md, "Precision"; docs/maths.md 1.6). Under ``torch.autocast``
every matmul inside an op would silently run in bfloat16 again, whatever dtype the op cast its
operands to: states came back in bfloat16 and AFT/decay outputs differed from the float32 result by
O(1). Autocast is therefore switched off for the op's own device while it runs; the op still returns
its output in the input dtype.

CPU bfloat16 products. ``linear_attn`` and ``delta_rule`` (``float32_compute(fn,
``float32_states``) may run the large products of their chunked form with bfloat16
operands while states, the state hand-off between chunks, the delta rule's triangular solve and
every normaliser stay float32. Whether they do is decided once per call, on entry, while the
caller's autocast state is still visible (``cpu_bf16_products``): only under
``torch.autocast("cpu", dtype=torch.bfloat16)``, and then by the environment variable
``FASTWEIGHTS_CPU_BF16``:

- ``auto`` (or unset/empty): on when the CPU has fast bfloat16 matrix products, i.e. AMX-BF16
  or AVX512-BF16 as ``torch.cpu.get_capabilities()`` reports them (``cpu_has_fast_bf16``). On
  other CPUs (AVX2, AVX-512 without BF16) a bfloat16 matmul is emulated in float32 arithmetic
  plus conversions and is slower than the float32 one, so auto keeps float32. ARM's BF16
  extensions are not counted (not measured here); ``on`` forces the path there.
- ``on``: always (under CPU bfloat16 autocast), whatever the CPU;
- ``off``: never: exactly the float32 computation of an op outside autocast.

Any other value is a ValueError naming the variable. The variable is read on every call made
under CPU autocast (not cached), so tests and benchmarks can switch it per call. Float16 CPU
autocast, CUDA autocast and calls outside autocast are untouched: float32 as before. The
decision reaches the op body (which runs with autocast off) through a thread-local flag, as
autocast's own state is thread-local; ops an opted-in op calls (its per-document calls for
packed batches) keep the flag, every other op clears it.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["CPU_BF16_ENV", "CPU_BF16_SETTINGS", "bf16_products", "cpu_bf16_products",
           "cpu_bf16_setting", "cpu_has_fast_bf16", "float32_compute", "float32_states",
           "products_dtype"]

F = TypeVar("F", bound=Callable[..., Any])

CPU_BF16_ENV = "FASTWEIGHTS_CPU_BF16"
CPU_BF16_SETTINGS = ("auto", "on", "off")
# The CPU features (torch.cpu.get_capabilities names) with native bfloat16 dot products that
# oneDNN's bfloat16 matmul uses: AMX tiles (Sapphire Rapids on) and AVX512-BF16 (Cooper Lake,
# Zen 4 on).
_FAST_BF16_FEATURES = ("amx_bf16", "avx512_bf16")

_local = threading.local()  # .bf16_products: the decision of the opted-in op now running


def cpu_bf16_setting() -> str:
    """The value of ``FASTWEIGHTS_CPU_BF16``: "auto" (also when unset or empty), "on" or "off"."""
    value = os.environ.get(CPU_BF16_ENV) or "auto"
    if value not in CPU_BF16_SETTINGS:
        raise ValueError(f"environment variable {CPU_BF16_ENV} must be one of "
                         f"{', '.join(CPU_BF16_SETTINGS)} (unset means auto), got {value!r}")
    return value


def cpu_has_fast_bf16() -> bool:
    """True when this CPU has AMX-BF16 or AVX512-BF16 (``torch.cpu.get_capabilities()``; torch
    before 2.10 lacks it, and its private per-feature checks are asked instead)."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        found = caps()
        return any(bool(found.get(f, False)) for f in _FAST_BF16_FEATURES)
    checks = (getattr(torch.cpu, "_is_amx_tile_supported", None),
              getattr(torch.cpu, "_is_avx512_bf16_supported", None))
    return any(check is not None and check() for check in checks)


def cpu_bf16_products() -> bool:
    """Whether an op called now takes the CPU bfloat16 product path: CPU autocast is on with
    dtype bfloat16 and ``FASTWEIGHTS_CPU_BF16`` is "on", or "auto" on a CPU with fast bfloat16
    (``cpu_has_fast_bf16``). A bad value of the variable is a ValueError even outside autocast."""
    setting = cpu_bf16_setting()
    if not (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16):
        return False
    return setting == "on" or (setting == "auto" and cpu_has_fast_bf16())


def bf16_products() -> bool:
    """Inside an op: whether its caller's autocast state chose the CPU bfloat16 product path
    (set on entry by ``float32_states``; False everywhere else)."""
    return getattr(_local, "bf16_products", False)


def float32_compute(fn: F, *, cpu_bf16: bool = False) -> F:
    """Run ``fn`` with autocast disabled on the device of its first tensor argument. With
    ``cpu_bf16``, a call on a CPU tensor under autocast first records
    ``cpu_bf16_products()`` for ``fn`` to read through ``bf16_products()``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or not torch.is_autocast_enabled(first.device.type):
            return fn(*args, **kwargs)  # validation reports a non-tensor; nothing to switch off
        chosen = cpu_bf16 and first.device.type == "cpu" and cpu_bf16_products()
        outer = getattr(_local, "bf16_products", False)
        _local.bf16_products = chosen
        try:
            with torch.autocast(first.device.type, enabled=False):
                return fn(*args, **kwargs)
        finally:
            _local.bf16_products = outer

    return wrapper  # type: ignore[return-value]


def float32_states(fn: F) -> F:
    """``float32_compute`` for the ops whose chunked form may take the CPU bfloat16 product path
    (states float32 either way): ``linear_attn`` and ``delta_rule``."""
    return float32_compute(fn, cpu_bf16=True)


def products_dtype(compute_dtype: torch.dtype) -> torch.dtype | None:
    """Inside an opted-in op: the operand dtype of its chunked form's large products,
    torch.bfloat16 on the CPU bfloat16 path (float32 compute only: float64 inputs, which
    autocast leaves alone, stay float64), else None (the compute dtype)."""
    return torch.bfloat16 if compute_dtype == torch.float32 and bf16_products() else None
