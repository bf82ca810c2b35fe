"""TTT-Linear's forward at head size 64 with one CTA of four warps per (batch, head), CUDA C++
(``cuda/ttt_linear_warp.cu``; docs/gpu_ttt_kernels.md, "Four warps per head"). It replaces
ops/ttt/triton.py's ``_linear_fwd_kernel`` inside ``_LinearTriton`` (same outputs, final
weights and bias, partial-mini-batch sums and checkpoints, so the Triton backward runs after
it), with the precision rule of ops/ttt/triton_resident.py's ``_linear_fwd_res_kernel``
(operands in the inputs' dtype, float32 master state and sums).

Opt-in: ``FASTWEIGHTS_TTT_FWD=cuda`` (ops/ttt/triton_regs.py ``fwd_variant``, read at every
call) until a GPU record shows it exact. It runs where everything it needs is there: a CUDA
device of compute capability 9.0 or newer, bfloat16 or float16 q, k, v, Dk = Dv = 64,
mini-batches of at most 16 tokens, 16-byte aligned q, k, v, and nvcc to build it on first use
(ops/ttt/cluster.py's ``build``: a shared library with a C entry, loaded with ctypes).
Otherwise one log line says why and the Triton forward runs.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from . import cluster

__all__ = ["HEAD_SIZE", "INT_FIELDS", "MAX_MINI_BATCH", "PTR_FIELDS", "SOURCE", "VARIANT",
           "LaunchArgs", "launch", "launch_forward", "problem", "refusal", "why_not"]

VARIANT = "cuda"  # FASTWEIGHTS_TTT_FWD's value that asks for it
SOURCE = cluster.SOURCE_DIR / "ttt_linear_warp.cu"
MIN_ARCH = 90
HEAD_SIZE = 64  # Dk = Dv: one warp holds a 16 x 64 row tile of every quantity
MAX_MINI_BATCH = 16  # one 16-row tile
DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2}  # the launcher's (float32 only emulated)
ALIGN = 16  # bytes: every lane reads q, k, v and writes o 16 bytes at a time

# cuda/ttt_linear_warp.h ``FwTTTLinearWarpArgs``'s fields in order: addresses, then ints
PTR_FIELDS = ("q", "k", "v", "eta", "tau", "A", "lnw", "lnb", "b0", "o", "w", "bias", "sw",
              "sb", "ckw", "ckb")
INT_FIELDS = ("B", "T", "H", "b", "N", "NF", "seg", "store_ck", "has_bias", "has_ln",
              "has_lnb", "residual")

_logger = logging.getLogger(__name__)
_build: dict[str, object] = {}  # "library" or "error", once per process
_logged: set[str] = set()


class LaunchArgs(ctypes.Structure):
    """``FwTTTLinearWarpArgs`` (cuda/ttt_linear_warp.h) as ctypes lays it out: what the
    launcher and the CPU emulation entry take."""

    _fields_ = ([(n, ctypes.c_void_p) for n in PTR_FIELDS]
                + [(n, ctypes.c_int) for n in INT_FIELDS])


def refusal(arch: int, dtype: torch.dtype, Dk: int, Dv: int, b: int) -> str | None:
    """Why the warp kernel cannot take a call on a CUDA device of compute capability ``arch``
    (90 for 9.0) with ``dtype`` inputs, head sizes Dk, Dv and mini-batches of b tokens (None:
    it can, once built)."""
    if arch < MIN_ARCH:
        return f"it needs sm_{MIN_ARCH} or newer, the device is sm_{arch}"
    if dtype not in DTYPE_CODES:
        return f"it takes bfloat16 or float16 inputs, got {dtype}"
    if Dk != HEAD_SIZE or Dv != HEAD_SIZE:
        return f"it takes Dk = Dv = {HEAD_SIZE}, got Dk {Dk}, Dv {Dv}"
    if b > MAX_MINI_BATCH:
        return f"it takes mini-batches of at most {MAX_MINI_BATCH} tokens, got {b}"
    return None


def why_not(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int) -> str | None:
    """``refusal`` for inputs q, k [B, T, H, Dk], v [B, T, H, Dv] where they are (a CPU
    tensor, a misaligned one: refused too)."""
    if q.device.type != "cuda":
        return f"it needs a CUDA device, the inputs are on {q.device.type}"
    major, minor = torch.cuda.get_device_capability(q.device)
    reason = refusal(10 * major + minor, q.dtype, q.shape[-1], v.shape[-1], b)
    if reason is None:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.data_ptr() % ALIGN:
                return f"it needs {ALIGN}-byte aligned inputs, {name} is not"
    return reason


def problem(q: torch.Tensor, b: int) -> str | None:
    """Why the warp kernel would not run a call with q, k, v like q [B, T, H, D] and
    mini-batches of b tokens, the library's build included (built here if it was not): None
    when it would."""
    reason = why_not(q, q, q, b)
    if reason is None and _library() is None:
        reason = str(_build.get("error"))
    return reason


def _library() -> ctypes.CDLL | None:
    """The loaded launcher, built on first use, or None (the reason in ``_build["error"]``)."""
    return cluster.load(_build, {
        "fw_ttt_linear_warp_launch": (ctypes.c_int, [ctypes.POINTER(LaunchArgs), ctypes.c_int,
                                                     ctypes.c_void_p]),
        "fw_ttt_linear_warp_error": (ctypes.c_char_p, [ctypes.c_int]),
    }, SOURCE)


def launch(lib: ctypes.CDLL, ptrs: list[int], ints: list[int], dtype_code: int,
           stream: int) -> None:
    """One launch through the library's C entry (``cluster.pack``'s lists for
    ``LaunchArgs``); a RuntimeError names the CUDA error."""
    cluster.call(lib.fw_ttt_linear_warp_launch, LaunchArgs(*ptrs, *ints),
                 (dtype_code, ctypes.c_void_p(stream)), lib.fw_ttt_linear_warp_error,
                 "the TTT-Linear warp kernel")


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        _logger.warning("fastweights.ops.ttt_linear: FASTWEIGHTS_TTT_FWD=%s asks for the CUDA "
                        "warp forward, which cannot run here (%s); the Triton kernel runs",
                        VARIANT, reason)


def launch_forward(L, store: bool, *args) -> bool:
    """Runs the warp forward in place of ``_linear_fwd_kernel`` for ops/ttt/triton.py's
    ``_LinearTriton`` (``L`` its ``_Shape``, ``args`` that kernel's pointer and size
    arguments, ``store`` whether to write the checkpoints) if it can run; returns whether it
    did, after one log line per reason when it cannot."""
    (q, k, v, eta, tau, A, lnw, lnb, b0, o, W, bias, S, s, ckw, ckb,
     T, H, _Dk, _Dv, b, N, NF, seg) = args
    reason = why_not(q, k, v, b)
    lib = None if reason else _library()
    if lib is None:
        _log_once(reason or str(_build.get("error")))
        return False
    flags = L.consts
    ptrs, ints = cluster.pack(
        (q, k, v, eta, tau, A, lnw if flags["HAS_LN"] else None,
         lnb if flags["HAS_LNB"] else None, b0 if flags["HAS_BIAS"] else None, o, W, bias, S,
         s, ckw, ckb),
        (L.B, T, H, b, N, NF, seg, store, flags["HAS_BIAS"], flags["HAS_LN"], flags["HAS_LNB"],
         flags["RESIDUAL"]),
        (PTR_FIELDS, INT_FIELDS))
    launch(lib, ptrs, ints, DTYPE_CODES[q.dtype], torch.cuda.current_stream(q.device).cuda_stream)
    return True
