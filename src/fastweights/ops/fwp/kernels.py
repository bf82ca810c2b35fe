"""This family's Triton kernels (``triton.py``, which needs triton), loaded on first use for the
dispatcher and the ops: ``triton_kernels()`` is the module, or None where triton is not
installed."""

from __future__ import annotations

from types import ModuleType

from ..backend import optional_module


def _load() -> ModuleType:
    from . import triton

    return triton


triton_kernels = optional_module(_load)
