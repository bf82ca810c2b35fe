"""Ahead-of-time compilation of every kernel launch of ops/fused/triton.py (the gated-delta
layer's fused short convolution and gated RMSNorm) for real GPU targets without a GPU, as
tests/ops/triton_aot.py does for the fast-weight kernels (whose launch recorder, compile and
worker pool this reuses).

Run as a script (``python tests/ops/triton_aot_fused.py OUT.json [DTYPE,... [arch ...]]``) in a
process where TRITON_INTERPRET is unset. The launches are recorded from the host code
(``short_conv_silu_triton`` and ``rms_norm_gated_triton``, forward and backward) on small CPU
tensors with the kernels replaced by recorders: the convolution at every tiling the host picks
(heads of 16 to 256 channels: BD 16 to 256) with conv sizes 2, 3 and 4 (the layer's default;
the forward's W is a constexpr), the norm with each gate (SiLU, sigmoid, none) and each output
dtype (the input's, float32), for each half dtype (float32 runs in PyTorch). Each distinct launch is compiled for both specialisations of
``SPECS``. One record per compile: registers, spill bytes, shared memory, or the error.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # triton_aot, run as a script or in a worker

from triton_aot import compile_in_pool, compile_record, distinct, recorded, write_records

ARCHS = (80, 90)
DTYPES = ("bfloat16", "float16")
GROUPS = (16, 32, 64, 128, 256)  # head sizes giving every BD the host picks (MAX_GROUP 256)
CONV_SIZES = (2, 3, 4)  # the forward's W is a constexpr (the backward's a run-time argument)
# The host hands the kernels 16-byte aligned pointers with unit last strides (``_aligned``); the
# sizes and strides are free ("odd": any T, channel count, head size, slice of a wider tensor)
# or all multiples of 16 ("aligned": the usual training shapes).
SPECS = ("odd", "aligned")
DIVISIBLE = {"odd": (), "aligned": ("T", "C", "G", "sxb", "sxt", "spb", "N", "D", "sxo", "sxi",
                                   "sgo", "sgi")}


def _run_host(module, dtype, groups=GROUPS, conv_sizes=CONV_SIZES) -> None:
    """Forward and backward of both ops through the host code, every launch recorded."""
    import torch

    for G in groups:  # two L2-normalised heads of G channels and 3 more channels
        for W in conv_sizes:
            C = 2 * G + 3
            x = torch.zeros(1, 5, C + 1, dtype=dtype)[..., 1:].requires_grad_()  # a slice
            weight = torch.zeros(C, 1, W, requires_grad=True)
            y = module.short_conv_silu_triton(x, weight, None, None, 2 * G, G, 1e-6)
            y.backward(torch.zeros_like(y))
    D, H = 40, 2
    for act in ("silu", "sigmoid", None):
        for out_dtype in (dtype, torch.float32):
            x = torch.zeros(1, 3, H, D, dtype=dtype, requires_grad=True)
            wide = torch.zeros(1, 3, H * D + 8, dtype=dtype, requires_grad=True)
            gate = None if act is None else wide[..., 8:].unflatten(-1, (H, D))
            weight = torch.zeros(D, requires_grad=True)
            y = module.rms_norm_gated_triton(x, weight, gate, 1e-5, act or "silu", out_dtype)
            y.backward(torch.zeros_like(y))


def signatures(dtype: str, arch: int) -> list[tuple]:
    """(kernel, name, signature, constexprs, num_warps, num_stages) of every distinct launch for
    ``dtype`` on sm_``arch``."""
    import importlib

    import torch

    module = importlib.import_module("fastweights.ops.fused.triton")
    with recorded((module,), arch) as out:
        _run_host(module, getattr(torch, dtype))
    found = distinct(out, lambda const: (
        f"[ACT={const['ACT']}" if "ACT" in const else
        f"[BD={const['BD']},W={const['W']}]" if "W" in const else f"[BD={const['BD']}]"))
    # the norm's launches differ in their output's (the gradient's) dtype too
    return [(fn, name if name.startswith("conv") else
             f"{name},{sig.get('y_ptr', sig.get('dy_ptr'))[1:]}]", sig, const, warps, stages)
            for fn, name, sig, const, warps, stages in found]


def specialization(sig: dict, spec: str) -> dict:
    """Triton's argument attributes of a launch: 16-byte aligned pointers and the integers of
    ``DIVISIBLE[spec]`` divisible by 16."""
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
            if ty.startswith("*") or name in DIVISIBLE[spec]}


def tasks(archs=ARCHS, dtypes=DTYPES) -> list[tuple]:
    """(arch, dtype, index into ``signatures``, specialization) of every compile."""
    return [(arch, dtype, i, spec) for arch in archs for dtype in dtypes
            for i in range(len(signatures(dtype, arch))) for spec in SPECS]


def compile_one(task: tuple) -> dict:
    """Compile one launch for its target; the record the tests assert on."""
    import triton

    arch, dtype, i, spec = task
    fn, name, sig, const, warps, stages = signatures(dtype, arch)[i]
    rec = {"kernel": name, "dtype": dtype, "arch": arch, "spec": spec, "num_warps": warps,
           "BR": const.get("BR"), "BD": const.get("BD"),
           "pointers": ",".join(t for t in sig.values() if t.startswith("*")),
           "triton": triton.__version__}
    return compile_record(rec, fn, sig, const, specialization(sig, spec), arch,
                          {"num_warps": warps, "num_stages": stages or 3})


def compile_all(archs=ARCHS, dtypes=DTYPES, processes: int | None = None) -> list[dict]:
    """Every record, compiled in a pool of worker processes (``triton_aot.compile_in_pool``)."""
    return compile_in_pool(compile_one, tasks(archs, dtypes), processes)


if __name__ == "__main__":
    write_records(compile_all, DTYPES, ARCHS)
