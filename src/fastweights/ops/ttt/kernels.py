"""The TTT Triton kernels (``triton.py`` and the one-token step's ``triton_decode.py``, which
need triton), loaded on first use for the dispatcher and the ops: ``triton_kernels()`` and
``decode_kernels()`` are the modules, or None where triton is not installed; and the head
sizes they take (``head_size_refusal``, part of the kernels' ``refuse`` hooks, inner_loop.py)."""

from __future__ import annotations

from types import ModuleType

from ..backend import optional_module


def _load() -> ModuleType:
    from . import triton

    return triton


triton_kernels = optional_module(_load)


def _load_decode() -> ModuleType:
    from . import triton_decode

    return triton_decode


decode_kernels = optional_module(_load_decode)


def head_size_refusal(Dk: int, Dv: int) -> str | None:
    """Why the TTT Triton kernels do not take heads of Dk, Dv (Dv > 128, or sizes that are not
    multiples of 16: the compiled, spill-free specialisations), or None; None also where
    triton is missing (the dispatcher says so)."""
    kernels = triton_kernels()
    if kernels is None:
        return None
    if Dv > kernels.MAX_D:
        return f"Dv={Dv}: the Triton kernels take Dv <= {kernels.MAX_D}"
    if Dk % kernels.HEAD_MULTIPLE or Dv % kernels.HEAD_MULTIPLE:
        return (f"Dk={Dk}, Dv={Dv}: the TTT Triton kernels take head sizes that are "
                f"multiples of {kernels.HEAD_MULTIPLE} (the compiled, spill-free "
                "specialisations)")
    return None
