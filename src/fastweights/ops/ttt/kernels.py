"""The TTT Triton kernels (``triton.py`` and the decoding step's ``triton_decode.py``, which
need triton), loaded on first use for the dispatcher and the ops: ``triton_kernels()`` and
``decode_kernels()`` are the modules, or None where triton is not installed."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import torch

from ..backend import ENV, Trial, choose_backend, optional_module


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


def triton_chosen(op: str, q: torch.Tensor, backend: str | None, mode: str, mini_batch_size: int,
                  why: str | None, trial: Callable[[], Trial]) -> bool:
    """Whether a call of ``op`` runs on its Triton kernel: the dispatcher's choice
    (ops/backend.py ``choose_backend``, from q's device, dtype, Dk, ``mode`` and the mini-batch
    size), unless ``why`` names something of the call the kernel cannot take that the
    dispatcher does not see: an explicit choice of triton is then a ValueError saying it, the
    automatic one runs PyTorch. ``trial`` makes the automatic choice's trial call."""
    explicit = backend is not None or bool(os.environ.get(ENV))
    if why is not None and not explicit:
        return False
    if choose_backend(op, q, backend, mode, mini_batch_size,
                      None if explicit else trial()) != "triton":
        return False
    if why is not None:
        source = "backend" if backend is not None else ENV
        raise ValueError(f"{source}='triton' cannot run {op}: {why}")
    return True
