"""Argument checks and the output gate shared by the AFT ops (docs/maths.md 4).

Dimension legend: B batch, T time, D channels (every channel its own head), H heads and Dh
channels per head (AFT-conv), s kernel/window size.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

from ..._checks import (
    check_bool,
    check_device,
    check_mode,
    check_positive_int,
    check_same_dtype_device,
    check_tensor,
)
from .._modes import RECURRENT_MODES
from ..backend import optional_module
from .chunk import banded_causal
from .naive import banded_naive
from .recurrent import banded_recurrent

MODES = RECURRENT_MODES


def _triton() -> ModuleType:
    from . import triton

    return triton


triton_kernels = optional_module(_triton)  # ops/aft/triton.py; None without triton


def kernel_refusal(q: torch.Tensor, facts: Mapping[str, Any]) -> str | None:
    """The AFT kernels' ``refuse`` hook (ops/backend.py ``Kernel``): what of a call they cannot
    take that the dispatcher does not see. q is the op's [B, T, D] queries with a unit head
    axis ([B, T, D, 1]); ``facts``: ``causal`` (AFT-local's kernels are causal) and ``carried``
    (they take calls without a carried state)."""
    if not facts.get("causal", True):
        return "causal=False: the kernels are causal"
    if facts.get("carried"):
        return "a carried state: the kernels take calls without one"
    return channels_refusal(q.shape[2])


def channels_refusal(D: int) -> str | None:
    """Why the AFT kernels do not take D channels (not a multiple of ``CHANNEL_MULTIPLE``, the
    compiled spill-free specialisations), or None (also where triton is missing: the dispatcher
    says so)."""
    kernels = triton_kernels()
    if kernels is None or D % kernels.CHANNEL_MULTIPLE == 0:
        return None
    return (f"D={D}: the AFT Triton kernels take channel counts that are multiples of "
            f"{kernels.CHANNEL_MULTIPLE} (the compiled, spill-free specialisations)")


def check_btd(q: Any, k: Any, v: Any) -> tuple[int, int, int]:
    """q, k, v: [B, T, D] of one shape, dtype and device. Returns (B, T, D)."""
    check_tensor("q", q, 3, "[B, T, D]")
    check_tensor("k", k, 3, "[B, T, D]")
    check_tensor("v", v, 3, "[B, T, D]")
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            raise ValueError(
                f"{name} must have the same shape as q [B, T, D] = {tuple(q.shape)}, "
                f"got {tuple(x.shape)}"
            )
    if min(q.shape) < 1:
        raise ValueError(f"q, k, v must have non-empty dims, got {tuple(q.shape)}")
    check_same_dtype_device(q=q, k=k, v=v)
    return tuple(q.shape)


def check_conv_qkv(q: Any, k: Any, v: Any) -> tuple[int, int, int, int]:
    """q, v: [B, T, H, Dh]; k: [B, T, H] (one key channel per head). Returns (B, T, H, Dh)."""
    check_tensor("q", q, 4, "[B, T, H, Dh]")
    check_tensor("v", v, 4, "[B, T, H, Dh]")
    if v.shape != q.shape:
        raise ValueError(
            f"v must have the same shape as q [B, T, H, Dh] = {tuple(q.shape)}, got {tuple(v.shape)}"
        )
    check_tensor("k", k)
    if k.dim() != 3 or k.shape != q.shape[:3]:
        raise ValueError(
            f"k must have shape [B, T, H] = {tuple(q.shape[:3])} (one key channel per head), "
            f"got {tuple(k.shape)}"
        )
    if min(q.shape) < 1:
        raise ValueError(f"q, k, v must have non-empty dims, got q {tuple(q.shape)}")
    check_same_dtype_device(q=q, k=k, v=v)
    return tuple(q.shape)


def check_bias_matrix(name: str, w: Any, rows: int, cols: int, exact_rows: bool, ref: torch.Tensor,
                      layout: str) -> torch.Tensor:
    """A 2-D float bias on ref's device with >= ``cols`` columns and ``rows`` rows (exactly, or
    at least); its dtype may differ from q's (it is a parameter; both are upcast)."""
    check_tensor(name, w, 2, layout)
    too_few = w.shape[0] != rows if exact_rows else w.shape[0] < rows
    if too_few or w.shape[1] < cols:
        want = f"{'exactly' if exact_rows else 'at least'} {rows} rows and at least {cols} columns"
        raise ValueError(f"{name} must have shape {layout} with {want}, got {tuple(w.shape)}")
    check_device(name, w, ref)
    return w


def check_kernel(w: Any, H: int, ref: torch.Tensor) -> int:
    """AFT-conv kernel w: [H, s] with s >= 1 on ref's device. Returns s."""
    check_tensor("w", w, 2, "[H, s]")
    if w.shape[0] != H or w.shape[1] < 1:
        raise ValueError(f"w must have shape [H, s] with H = {H} and s >= 1, got {tuple(w.shape)}")
    check_device("w", w, ref)
    return w.shape[1]


def check_flags(causal: Any, initial_state: Any, output_final_state: Any, mode: Any,
                chunk_size: Any) -> None:
    """The AFT ops' flags: causal and output_final_state bools, mode one of MODES, chunk_size
    >= 1; a bidirectional call (causal=False) carries no state and has no recurrent form."""
    check_bool("causal", causal)
    check_bool("output_final_state", output_final_state)
    check_mode(mode, MODES)
    check_positive_int("chunk_size", chunk_size)
    if causal:
        return
    if initial_state is not None or output_final_state:
        raise ValueError("causal=False carries no state (every row reads the whole call): "
                         "initial_state must be None and output_final_state False")
    if mode == "recurrent":
        raise ValueError("mode='recurrent' needs causal=True (a bidirectional row reads later "
                         "tokens); use mode='chunk' or 'naive'")


def banded_stream(k: torch.Tensor, v: torch.Tensor, band: torch.Tensor, window: int,
                  state: tuple | None, mode: str, chunk_size: int, *,
                  global_context: bool = True, signed: bool = False) -> tuple[torch.Tensor, tuple]:
    """The causal banded sums of AFT-local/conv in the chosen ``mode`` (chunk.py, recurrent.py,
    naive.py). band [T|1, G|1, J] or [T|1, B, G|1, J] (per row) in time order, band[..., -1 - o]
    at offset o: the biases, or with ``signed`` the weights. One token (a decoding step) takes
    the recurrent form in mode "chunk": it reads the cached window as it is, where the chunked
    form would rebuild prefix sums over cache and token. AFT-conv's ablations
    (``global_context=False``, ``signed``) have the chunked and naive forms (the op checks)."""
    if mode == "naive":
        natural = band.flip(-1)  # [..., o]: the bias at offset o
        natural = natural if natural.dim() == 4 else natural.unsqueeze(1)
        return banded_naive(k, v, natural, 0, True, window, state, global_context=global_context,
                            signed=signed)
    if signed or not global_context:
        signs = torch.sign(band).detach() if signed else None
        return banded_causal(k, v, torch.log(band.abs()) if signed else band, window, state,
                             chunk_size, global_context=global_context, signs=signs)
    if mode == "chunk" and k.shape[1] > 1:
        return banded_causal(k, v, band, window, state, chunk_size)
    return banded_recurrent(k, v, band, window, state)


def gate(q: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """o = sigmoid(Q) * ratio, computed in the compute dtype and returned in q's dtype."""
    return (torch.sigmoid(q.to(ratio.dtype)) * ratio).to(q.dtype)
