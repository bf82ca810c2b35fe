"""What the Triton kernels of every family share on the host side: the target a launch compiles
for and the precision of ``tl.dot`` per input dtype (docs/kernels.md, "Precision"). Imports
``triton`` at import time; only the families' ``triton.py`` modules import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton


def _arch(device: torch.device) -> int:
    """The compute capability the launch compiles for (10 * major + minor); 80 off CUDA (the
    interpreter), so the tiling there is sm_80's."""
    if device.type != "cuda":
        return 80
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _upcast_tiles(dtype: torch.dtype) -> bool:
    """Whether the kernels upcast their bfloat16 input tiles to float32 before tl.dot.

    Only under the CPU interpreter (TRITON_INTERPRET=1), whose bfloat16 tl.dot returns garbage
    (Triton 3.9; float16 and float32 are right). The upcast computes the same thing: a product
    of two bfloat16 numbers is exact in float32, so the float32 dot differs from the tensor-core
    bfloat16 dot with float32 accumulation only in summation order."""
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


def precisions(dtype: torch.dtype) -> tuple[str, str]:
    """(IN_PREC, F32_PREC): tl.dot precision for products of two input tiles and for products
    with a float32 operand (docs/kernels.md, "Precision")."""
    if dtype == torch.float32 or _upcast_tiles(dtype):
        return "ieee", "ieee" if dtype == torch.float32 else "tf32"
    return "tf32", "tf32"


def _pow2(n: int) -> int:
    """The block a size of n fills: the next power of two, at least 16 (one tl.dot tile)."""
    return max(16, triton.next_power_of_2(n))


def tiled_everywhere(tile_config: Callable[..., Any], op: str, dtype: torch.dtype,
                     max_d: int) -> bool:
    """Whether ``tile_config(arch, dtype, op, D)`` has a tiling on every target (sm_80, sm_90)
    for the head sizes up to ``max_d`` (the tiles change at 64): a TTT module's ``supports``."""
    return all(tile_config(arch, dtype, op, D) is not None for arch in (80, 90)
               for D in (64, max_d))
