"""TTT-MLP's forward with the inner weights on chip, the hidden units split over the CTAs of a
thread-block cluster (CUDA C++ for sm_90, ``cuda/ttt_mlp_cluster.cu``; docs/gpu_ttt_kernels.md,
"TTT-MLP on a thread-block cluster"). It replaces ops/ttt/triton.py's ``_mlp_fwd_kernel`` inside
``_MLPTriton`` (same outputs, final weights, partial-mini-batch sums and checkpoints, so the
Triton backward runs after it) and its backward's ``_mlp_recompute_kernel``; its arithmetic is
ops/ttt/cluster_model.py's, step for step. The backward's sequential pass over each full
segment runs on the same cluster (``ttt_mlp_cluster_bwd_b``, in place of
``_mlp_bwd_b_kernel``; ops/ttt/cluster_bwd_model.py's arithmetic), and so does the read-out's
backward before it (``ttt_mlp_cluster_bwd_a``, in place of ``_mlp_bwd_a_kernel``: one cluster per
mini-batch of the segment).

Opt-in: ``FASTWEIGHTS_TTT_MLP_FWD=cluster`` (read at every call, for all of them; "stream", the
default, is the Triton kernels) until a GPU record shows them exact. It runs where everything it needs is there:
a CUDA device of compute capability 9.0 or newer, bfloat16 or float16 q, k, v, Dk = Dv in
(64, 128), Dh = 4 Dk, mini-batches of at most 16 tokens, and nvcc to build it on first use (a
shared library with a C entry, loaded with ctypes: no compiler toolchain beyond nvcc, no
PyTorch headers). Otherwise one log line says why and the Triton kernel runs.

Dimension legend: B batch, T time, H heads, D = Dk = Dv, Dh hidden units, b mini-batch size.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["BWD_A_INT_FIELDS", "BWD_A_PTR_FIELDS", "BWD_INT_FIELDS", "BWD_PTR_FIELDS", "ENV",
           "HEAD_SIZES", "INT_FIELDS", "MAX_MINI_BATCH", "NVCC_FLAGS", "PTR_FIELDS", "SOURCE_DIR",
           "VARIANT", "BwdALaunchArgs", "BwdLaunchArgs", "LaunchArgs", "build", "call", "fwd_variant",
           "launch", "launch_backward_a", "launch_backward_b", "launch_bwd", "launch_bwd_a",
           "launch_forward", "launch_recompute", "load", "pack", "problem", "refusal", "why_not"]

ENV = "FASTWEIGHTS_TTT_MLP_FWD"
VARIANT = "cluster"
VARIANTS = ("stream", VARIANT)
SOURCE_DIR = Path(__file__).parent / "cuda"
SOURCE = SOURCE_DIR / "ttt_mlp_cluster.cu"
MIN_ARCH = 90  # thread-block clusters and distributed shared memory
DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2}  # the launcher's (float32 only emulated)
HEAD_SIZES = (64, 128)  # clusters of 2 and 4 CTAs of 128 hidden units
MAX_MINI_BATCH = 16  # one 16-row tile
# sm_90 machine code, and compute_90 PTX that the driver compiles for newer GPUs
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90",
              "-gencode=arch=compute_90,code=compute_90")
CACHE_ENV = "FASTWEIGHTS_CACHE"  # where the built library is kept (default ~/.cache/fastweights)

_logger = logging.getLogger(__name__)
_build: dict[str, object] = {}  # "library" or "error", once per process
_logged: set[str] = set()

# cuda/ttt_mlp_cluster.h ``FwTTTMLPClusterArgs``'s fields in order: addresses, then ints
PTR_FIELDS = ("q", "k", "v", "eta", "tau", "lnw", "lnb", "w1", "c1", "w2", "c2", "o", "s1", "sb1",
              "s2", "sb2", "ck1", "ckb1", "ck2", "ckb2")
INT_FIELDS = ("B", "T", "H", "b", "N", "NF", "seg", "store_ck", "has_b1", "has_b2", "has_ln",
              "has_lnb", "residual")


# cuda/ttt_mlp_cluster.h ``FwTTTMLPClusterBwdArgs``'s fields in order: addresses, then ints
BWD_PTR_FIELDS = ("q", "k", "v", "eta", "tau", "A", "lnw", "lnb", "w1", "w2", "dw1", "db1", "dw2",
                  "db2", "hs", "vs", "rr", "at", "acc", "dtau", "dk", "dv", "deta")
BWD_INT_FIELDS = ("B", "T", "H", "b", "N", "n0", "n1", "seg", "w_bh", "w_j", "has_b1", "has_b2",
                  "has_ln", "has_lnb", "residual")


# cuda/ttt_mlp_cluster.h ``FwTTTMLPClusterBwdAArgs``'s fields in order: addresses, then ints
BWD_A_PTR_FIELDS = ("q", "k", "v", "eta", "tau", "A", "lnw", "lnb", "w1", "b1", "w2", "b2", "dout",
                    "hs", "vs", "rr", "at", "acc", "dtau", "dq", "dk", "deta")
BWD_A_INT_FIELDS = BWD_INT_FIELDS


class LaunchArgs(ctypes.Structure):
    """``FwTTTMLPClusterArgs`` (cuda/ttt_mlp_cluster.h) as ctypes lays it out: what the
    launcher and the CPU emulation entry take."""

    _fields_ = ([(n, ctypes.c_void_p) for n in PTR_FIELDS]
                + [(n, ctypes.c_int) for n in INT_FIELDS])


class BwdLaunchArgs(ctypes.Structure):
    """``FwTTTMLPClusterBwdArgs`` (cuda/ttt_mlp_cluster.h) as ctypes lays it out: what the
    backward pass's launcher and emulation entry take."""

    _fields_ = ([(n, ctypes.c_void_p) for n in BWD_PTR_FIELDS]
                + [(n, ctypes.c_int) for n in BWD_INT_FIELDS])


class BwdALaunchArgs(ctypes.Structure):
    """``FwTTTMLPClusterBwdAArgs`` (cuda/ttt_mlp_cluster.h) as ctypes lays it out: what the
    read-out backward's launcher and emulation entry take."""

    _fields_ = ([(n, ctypes.c_void_p) for n in BWD_A_PTR_FIELDS]
                + [(n, ctypes.c_int) for n in BWD_A_INT_FIELDS])


def fwd_variant() -> str:
    """The TTT-MLP forward kernel a call runs: ``FASTWEIGHTS_TTT_MLP_FWD`` "stream" (default,
    ops/ttt/triton.py's ``_mlp_fwd_kernel``) or "cluster" (this module's). Another value is a
    ValueError."""
    env = os.environ.get(ENV, "") or VARIANTS[0]
    if env not in VARIANTS:
        raise ValueError(f"{ENV} must be one of {', '.join(VARIANTS)}, got {env!r}")
    return env


def why_not(q: torch.Tensor, Dv: int, Dh: int, b: int) -> str | None:
    """Why the cluster kernel cannot take a call with queries like q [B, T, H, Dk], value size
    Dv, Dh hidden units and mini-batches of b tokens (None: it can, once built)."""
    if q.device.type != "cuda":
        return f"it needs a CUDA device, the inputs are on {q.device.type}"
    major, minor = torch.cuda.get_device_capability(q.device)
    return refusal(10 * major + minor, q.dtype, q.shape[-1], Dv, Dh, b)


def refusal(arch: int, dtype: torch.dtype, Dk: int, Dv: int, Dh: int, b: int) -> str | None:
    """``why_not`` for a CUDA device of compute capability ``arch`` (90 for 9.0)."""
    if arch < MIN_ARCH:
        return (f"it needs sm_{MIN_ARCH} or newer (thread-block clusters), the device is "
                f"sm_{arch}")
    if dtype not in DTYPE_CODES:
        return f"it takes bfloat16 or float16 inputs, got {dtype}"
    if Dk != Dv or Dk not in HEAD_SIZES:
        return f"it takes Dk = Dv in {HEAD_SIZES}, got Dk {Dk}, Dv {Dv}"
    if Dh != 4 * Dk:
        return f"it takes Dh = 4 Dk hidden units, got {Dh}"
    if b > MAX_MINI_BATCH:
        return f"it takes mini-batches of at most {MAX_MINI_BATCH} tokens, got {b}"
    return None


def build(out_dir: Path | None = None, report: bool = False, source: Path = SOURCE) -> Path:
    """The launcher's shared library, compiled by nvcc from ``source`` (default
    ``cuda/ttt_mlp_cluster.cu``; another kernel file of ``SOURCE_DIR``) into ``out_dir`` (default: ``$FASTWEIGHTS_CACHE`` or ~/.cache/fastweights) under a name that
    hashes the sources and flags, so an existing build is reused. With ``report``, ptxas'
    register and spill report (``-Xptxas -v``) is kept beside it, in ``<library>.ptxas.txt``.
    A RuntimeError says why it cannot be built (no nvcc, the compiler's last messages)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH")
    flags = (*NVCC_FLAGS, "-Xptxas", "-v") if report else NVCC_FLAGS
    h = hashlib.sha256(" ".join(flags).encode())
    for path in sorted(SOURCE_DIR.glob("*.[ch]*")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    out_dir = Path(out_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fastweights")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"{source.stem}-{h.hexdigest()[:16]}.so"
    if not lib.exists():
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            part = Path(tmp) / lib.name
            cmd = [nvcc, *flags, "-Xcompiler", "-fPIC", "-shared", "-I", str(SOURCE_DIR),
                   str(source), "-o", str(part)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"nvcc failed: {(done.stderr or done.stdout)[-500:].strip()}")
            if report:
                lib.with_suffix(".ptxas.txt").write_text(done.stdout + done.stderr)
            part.replace(lib)  # another process may have built it meanwhile: same bytes
    return lib


def load(state: dict, signatures: dict[str, tuple], source: Path = SOURCE) -> ctypes.CDLL | None:
    """The shared library built from ``source`` (``build``) and loaded, its C entries typed by
    ``signatures`` (name: (restype, argtypes)), kept in ``state`` after the first call: None
    if it cannot be built or loaded (the reason in ``state["error"]``)."""
    if "library" not in state and "error" not in state:
        try:
            lib = ctypes.CDLL(str(build(source=source)))
            for name, (restype, argtypes) in signatures.items():
                entry = getattr(lib, name)
                entry.restype, entry.argtypes = restype, argtypes
            state["library"] = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            state["error"] = f"building it failed: {err}"
    return state.get("library")


def _library() -> ctypes.CDLL | None:
    """The loaded launcher, built on first use, or None (the reason in ``_build["error"]``)."""
    launcher = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]  # dtype code, D, stream
    return load(_build, {
        "fw_ttt_mlp_cluster_launch": (ctypes.c_int, [ctypes.POINTER(LaunchArgs), *launcher]),
        "fw_ttt_mlp_cluster_bwd_b_launch": (ctypes.c_int,
                                            [ctypes.POINTER(BwdLaunchArgs), *launcher]),
        "fw_ttt_mlp_cluster_bwd_a_launch": (ctypes.c_int,
                                            [ctypes.POINTER(BwdALaunchArgs), *launcher]),
        "fw_ttt_mlp_cluster_error": (ctypes.c_char_p, [ctypes.c_int]),
    })


def launch(lib: ctypes.CDLL, ptrs: list[int], ints: list[int], dtype_code: int, D: int,
           stream: int) -> None:
    """One launch of the forward through the library's C entry (``pack``'s lists); a
    RuntimeError names the CUDA error."""
    _call(lib.fw_ttt_mlp_cluster_launch, LaunchArgs, "kernel", lib, ptrs, ints, dtype_code, D,
          stream)


def problem(q: torch.Tensor, Dv: int, Dh: int, b: int) -> str | None:
    """Why the cluster kernel would not run a call like ``why_not``'s, the library's build
    included (built here if it was not): None when it would."""
    reason = why_not(q, Dv, Dh, b)
    if reason is None and _library() is None:
        reason = str(_build.get("error"))
    return reason


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        _logger.warning("fastweights.ops.ttt_mlp: %s=%s asks for the cluster forward, which "
                        "cannot run here (%s); the Triton kernel runs", ENV, VARIANT, reason)


def pack(tensors: Sequence[torch.Tensor | None], sizes: Sequence[int],
         fields: tuple[tuple[str, ...], tuple[str, ...]] = (PTR_FIELDS, INT_FIELDS)
         ) -> tuple[list[int], list[int]]:
    """A launcher's arguments in its struct's order, ``fields`` its (address, int) field names:
    by default the forward's (cuda/ttt_mlp_cluster.h ``FwTTTMLPClusterArgs``: the addresses of
    q, k, v, eta, tau, lnw, lnb, w1, c1, w2, c2, o, s1, sb1, s2, sb2, ck1, ckb1, ck2, ckb2, 0 for
    None, and the ints B, T, H, b, N, NF, seg, store_ck, has_b1, has_b2, has_ln, has_lnb,
    residual); (BWD_PTR_FIELDS, BWD_INT_FIELDS) for the backward pass's."""
    ptr_fields, int_fields = fields
    if len(tensors) != len(ptr_fields) or len(sizes) != len(int_fields):
        raise ValueError(f"pack takes {len(ptr_fields)} tensors and {len(int_fields)} sizes, "
                         f"got {len(tensors)} and {len(sizes)}")
    for name, x in zip(ptr_fields, tensors):
        if x is not None and not x.is_contiguous():
            raise ValueError(f"pack: {name} must be contiguous")
    return [0 if x is None else x.data_ptr() for x in tensors], [int(s) for s in sizes]


def _call(entry, args_type: type, what: str, lib: ctypes.CDLL, ptrs: list[int],
          ints: list[int], dtype_code: int, D: int, stream: int) -> None:
    """One launch through the library's C ``entry`` taking ``args_type``; a RuntimeError
    names the CUDA error (``what``: the kernel, for the message)."""
    call(entry, args_type(*ptrs, *ints), (dtype_code, D, ctypes.c_void_p(stream)),
         lib.fw_ttt_mlp_cluster_error, f"the TTT-MLP cluster {what}")


def call(entry, args: ctypes.Structure, extra: tuple, error, what: str) -> None:
    """Calls a library's C launch ``entry`` with a pointer to ``args`` and ``extra``; a nonzero
    CUDA error code becomes a RuntimeError naming ``what`` and the error (``error``: the
    library's code-to-name entry)."""
    err = entry(ctypes.byref(args), *extra)
    if err != 0:
        raise RuntimeError(f"{what}'s launch failed: CUDA error {err}, {error(err).decode()}")


def launch_bwd(lib: ctypes.CDLL, ptrs: list[int], ints: list[int], dtype_code: int, D: int,
               stream: int) -> None:
    """One launch of the backward pass through the library's C entry (``pack``'s lists for
    ``BwdLaunchArgs``); a RuntimeError names the CUDA error."""
    _call(lib.fw_ttt_mlp_cluster_bwd_b_launch, BwdLaunchArgs, "backward", lib, ptrs, ints,
          dtype_code, D, stream)


def launch_bwd_a(lib: ctypes.CDLL, ptrs: list[int], ints: list[int], dtype_code: int, D: int,
                 stream: int) -> None:
    """One launch of the read-out's backward through the library's C entry (``pack``'s lists
    for ``BwdALaunchArgs``); a RuntimeError names the CUDA error."""
    _call(lib.fw_ttt_mlp_cluster_bwd_a_launch, BwdALaunchArgs, "read-out backward", lib, ptrs,
          ints, dtype_code, D, stream)


def _ready(q: torch.Tensor, L, Dh: int) -> ctypes.CDLL | None:
    """The library if ``FASTWEIGHTS_TTT_MLP_FWD`` asks for the cluster kernel and it can run
    on inputs like q (``L``: ops/ttt/triton.py's ``_Shape``), else None (one log line per
    reason when it was asked for)."""
    if fwd_variant() != VARIANT:
        return None
    reason = why_not(q, L.Dv, Dh, L.b)
    lib = None if reason else _library()
    if lib is None:
        _log_once(reason or str(_build.get("error")))
    return lib


def _run(lib: ctypes.CDLL, L, q, k, v, eta, tau, lnw, lnb, w1, c1, w2, c2, o, sums, cks,
         N: int, NF: int, seg: int, store: bool) -> None:
    flags = L.consts
    ptrs, ints = pack(
        (q, k, v, eta, tau, lnw, lnb, w1, c1, w2, c2, o, *sums, *cks),
        (L.B, L.T, L.H, L.b, N, NF, seg, store, flags["HAS_B1"], flags["HAS_B2"],
         flags["HAS_LN"], flags["HAS_LNB"], flags["RESIDUAL"]))
    launch(lib, ptrs, ints, DTYPE_CODES[q.dtype], L.Dk,
           torch.cuda.current_stream(q.device).cuda_stream)


def launch_forward(L, store: bool, q, k, v, eta, tau, lnw, lnb, w1, c1, w2, c2, o, sums,
                   cks) -> bool:
    """Runs the cluster forward in place of ``_mlp_fwd_kernel`` for ops/ttt/triton.py's
    ``_MLPTriton`` (``L`` its ``_Shape``; the tensors as that kernel takes them: w1, c1, w2, c2
    updated in place, o, the sums and the checkpoints ``cks`` written) if
    ``FASTWEIGHTS_TTT_MLP_FWD`` asks for it and it can run; returns whether it did."""
    lib = _ready(q, L, w1.shape[-1])
    if lib is None:
        return False
    _run(lib, L, q, k, v, eta, tau, lnw, lnb, w1, c1, w2, c2, o, sums, cks, L.N, L.T // L.b,
         L.seg, store)
    return True


def launch_recompute(L, q, k, v, eta, tau, lnw, lnb, slots, n0: int, n1: int) -> bool:
    """Runs the cluster forward in place of ``_mlp_recompute_kernel`` for ``_MLPTriton``'s
    backward (the same switch): from the checkpoint in slot 0 of ``slots`` (w1, b1, w2, b2
    [B*H, S, ...], S = seg + 1, float32), mini-batches n0 .. n1-1 of the segment, the weights
    entering mini-batch n0 + j written into slot j (slot 0 again, unchanged, and slot
    n1 - 1 - n0, which needs the segment's last mini-batch run too); returns whether it did.

    The kernel runs unchanged: q, k, v and eta start at token n0 b (their heads' strides are
    those of the whole sequence, T tokens), every mini-batch is a checkpoint (seg 1), and
    ``NF`` = S >= n1 - n0 makes its checkpoints S apart with no partial mini-batch. The
    weights after the segment and its read-out go to scratch."""
    lib = _ready(q, L, slots[0].shape[-1])
    if lib is None:
        return False
    t0 = n0 * L.b
    shifted = [x.view(-1)[t0 * x.stride(1):] for x in (q, k, v, eta)]  # [B, T, H, ...] strides
    start = [x[:, 0].clone() for x in slots]  # the kernel's in-place weights: a scratch copy
    o = torch.empty_like(q)  # the read-out, unused
    _run(lib, L, *shifted, tau, lnw, lnb, *start, o, [start[0]] * 4, slots, n1 - n0,
         slots[0].shape[1], 1, True)
    return True


def _segment(L, q: torch.Tensor, Dh: int, tensors: tuple, sizes: tuple[int, ...],
             fields: tuple[tuple[str, ...], tuple[str, ...]], launcher) -> bool:
    """One backward launch for a segment of ``_MLPTriton``'s backward (``L`` its ``_Shape``)
    through ``launcher`` (``launch_bwd`` or ``launch_bwd_a``), its struct's ``fields``, the
    ``tensors`` in their order and the segment's ``sizes`` T, H, b, N, n0, n1, seg, w_bh, w_j
    (the flags follow, as in ``BWD_INT_FIELDS``), if ``FASTWEIGHTS_TTT_MLP_FWD`` asks for the
    cluster kernels and they can run; returns whether it did."""
    lib = _ready(q, L, Dh)
    if lib is None:
        return False
    f = L.consts
    ptrs, ints = pack(tensors, (L.B, *sizes, f["HAS_B1"], f["HAS_B2"], f["HAS_LN"],
                                f["HAS_LNB"], f["RESIDUAL"]), fields)
    launcher(lib, ptrs, ints, DTYPE_CODES[q.dtype], L.Dk,
             torch.cuda.current_stream(q.device).cuda_stream)
    return True


def launch_backward_b(L, args: tuple, tail: bool) -> bool:
    """Runs the backward's sequential pass on the cluster in place of one launch of
    ``_mlp_bwd_b_kernel`` (``args`` that kernel's positional arguments, ops/ttt/triton.py's
    ``back``) for a full segment (``tail`` False) if ``FASTWEIGHTS_TTT_MLP_FWD`` asks for the
    cluster kernels and they can run; returns whether it did. A partial last mini-batch stays
    on the Triton kernel."""
    if tail:
        return False
    (q, k, v, eta, tau, A, lnw, lnb, w1, w2, _ds1, _dsb1, _ds2, _dsb2, dw1, db1, dw2, db2, hs, vs,
     rr, at, _sc, acc, dtau, dk, dv, deta, T, H, _Dk, _Dv, Dh, b, N, n0, n1, seg, w_bh,
     w_j) = args
    flags = L.consts
    return _segment(
        L, q, Dh,
        (q, k, v, eta, tau, A, lnw if flags["HAS_LN"] else None,
         lnb if flags["HAS_LNB"] else None, w1, w2, dw1, db1, dw2, db2, hs, vs, rr, at, acc,
         dtau, dk, dv, deta),
        (T, H, b, N, n0, n1, seg, w_bh, w_j), (BWD_PTR_FIELDS, BWD_INT_FIELDS), launch_bwd)


def launch_backward_a(L, args: tuple, tail: bool) -> bool:
    """Runs the read-out's backward on clusters in place of one launch of ``_mlp_bwd_a_kernel``
    (``args`` that kernel's positional arguments, ops/ttt/triton.py's ``back``) for a full
    segment (``tail`` False) if ``FASTWEIGHTS_TTT_MLP_FWD`` asks for the cluster kernels and
    they can run; returns whether it did. A partial last mini-batch stays on the Triton
    kernel."""
    if tail:
        return False
    (q, k, v, eta, tau, A, lnw, lnb, w1, b1, w2, b2, do, hs, vs, rr, at, acc, dtau, dq, dk,
     deta, T, H, _Dk, _Dv, Dh, b, N, n0, n1, seg, w_bh, w_j) = args
    flags = L.consts
    return _segment(
        L, q, Dh,
        (q, k, v, eta, tau, A, lnw if flags["HAS_LN"] else None,
         lnb if flags["HAS_LNB"] else None, w1, b1 if flags["HAS_B1"] else None, w2,
         b2 if flags["HAS_B2"] else None, do, hs, vs, rr, at, acc, dtau, dq, dk, deta),
        (T, H, b, N, n0, n1, seg, w_bh, w_j), (BWD_A_PTR_FIELDS, BWD_A_INT_FIELDS),
        launch_bwd_a)
