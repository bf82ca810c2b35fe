"""Which implementation runs mode="chunk" of the fast-weight ops: the Triton kernels of
``triton.py`` on CUDA (``FASTWEIGHTS_TRITON=0`` turns them off) or PyTorch everywhere else, and
the chunk sizes measured fastest per device kind.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Chunk sizes measured per device kind (forward and forward+backward, B1 H8 T4096 D64 float32;
# `python -m fastweights.bench.fwp_forms --backward --chunk-sizes 16,32,64,128 --modes chunk`,
# recorded in benchmarks/results/chunk_sizes/). Devices not measured here keep 64, the size
# flash-linear-attention's GPU kernels use.
PREFERRED_CHUNK_SIZES: dict[str, dict[str, int]] = {
    "cpu": {"linear_attn": 64, "delta_rule": 32},
}


def preferred_chunk_size(op: str, device: torch.device | str) -> int:
    """The measured fastest ``chunk_size`` of ``op`` (``"linear_attn"`` or ``"delta_rule"``) on
    this kind of device (see ``PREFERRED_CHUNK_SIZES``); 64 where nothing was measured. Layers
    built with ``chunk_size=None`` use it; the ops themselves keep DESIGN's default of 64."""
    if op not in ("linear_attn", "delta_rule"):
        raise ValueError(f"op must be 'linear_attn' or 'delta_rule', got {op!r}")
    return PREFERRED_CHUNK_SIZES.get(torch.device(device).type, {}).get(op, 64)


_logger = logging.getLogger(__name__)
_fallbacks_logged: set[str] = set()


def _triton_module() -> ModuleType | None:
    """``ops/fwp/triton.py``, imported on first use; None where triton is not installed."""
    try:
        from . import triton as kernels
    except ImportError:
        return None
    return kernels


def _use_triton(q: torch.Tensor) -> bool:
    """Whether mode="chunk" runs the Triton kernels: q on CUDA in float16/bfloat16/float32,
    ``FASTWEIGHTS_TRITON`` not "0" and triton importable. float64 and CPU always use PyTorch.
    A CUDA tensor that falls back for another reason says why once per reason (logging info)."""
    if not q.is_cuda or q.dtype not in TRITON_DTYPES:
        return False
    if os.environ.get("FASTWEIGHTS_TRITON", "1") == "0":
        reason = "FASTWEIGHTS_TRITON=0"
    elif _triton_module() is None:
        reason = "triton is not installed (pip install fastweights[triton])"
    else:
        return True
    if reason not in _fallbacks_logged:
        _fallbacks_logged.add(reason)
        _logger.info("fastweights.ops.fwp: CUDA input, using the PyTorch chunk path: %s", reason)
    return False
