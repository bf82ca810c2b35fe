"""Ahead-of-time compilation of every kernel launch of ops/aft/triton.py (AFT's kernels) for real
GPU targets without a GPU, as tests/ops/triton_aot.py does for the fast-weight kernels (whose
launch recorder, compile and worker pool this reuses).

Run as a script (``python tests/ops/triton_aot_aft.py OUT.json [DTYPE,... [arch ...]]``) in a
process where TRITON_INTERPRET is unset. The launches are recorded from the host code:
``_AFTTriton``'s forward and backward, AFT-full causal (with a cached past: first > 0) and
bidirectional and causal AFT-local, on small CPU tensors with the kernels replaced by recorders,
for each half input dtype (the dispatcher sends float32 to PyTorch: ``supports``). Each distinct launch is compiled
for both specialisations of ``SPECS``. One record per compile: registers, spill bytes, shared
memory, or the error.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # triton_aot, run as a script or in a worker

from triton_aot import _Ctx, compile_in_pool, compile_record, distinct, recorded, write_records

ARCHS = (80, 90)
DTYPES = ("bfloat16", "float16")
# The dispatcher sends channel counts D that are multiples of 16 only (``HEAD_MULTIPLE``): a
# launch is "aligned" (every size a multiple of 16) or "odd_T" (D only; T, L and w's row
# stride free), never "generic".
SPECS = ("odd_T", "aligned")
DIVISIBLE = {"aligned": ("T", "L", "D", "sw0"), "odd_T": ("D",)}


def _run_host(module, dtype) -> None:
    """One forward and backward of ``_AFTTriton``: AFT-full causal (with a cached past of 3
    keys) and bidirectional, and AFT-local (window 3), every launch recorded instead of run."""
    import torch

    B, T, D = 1, 5, 8
    for causal, first, window in ((True, 3, 0), (False, 0, 0), (True, 0, 3)):
        q = torch.zeros(B, T, D, dtype=dtype)
        k = v = torch.zeros(B, first + T, D, dtype=dtype)
        w = torch.zeros(T, window or first + T, dtype=torch.float32)
        ctx = _Ctx()
        ctx.needs_input_grad = (True, True, True, True, False, False, False)
        ctx.mark_non_differentiable = lambda *xs: None
        o, _ = module._AFTTriton.forward(ctx, q, k, v, w, first, causal, window)
        module._AFTTriton.backward(ctx, torch.zeros_like(o), None)


def signatures(dtype: str, arch: int) -> list[tuple]:
    """(kernel, name, signature, constexprs, num_warps, num_stages) of every distinct launch for
    ``dtype`` on sm_``arch``."""
    import importlib

    import torch

    module = importlib.import_module("fastweights.ops.aft.triton")
    with recorded((module,), arch) as out:
        _run_host(module, getattr(torch, dtype))
    return distinct(out, lambda const: "" if "CAUSAL" not in const else (
        "[local]" if const["LOCAL"] else "[causal]" if const["CAUSAL"] else "[bidir]"))


def specialization(sig: dict, spec: str) -> dict:
    """Triton's argument attributes of a launch: 16-byte aligned pointers (torch allocations)
    and the integers of ``DIVISIBLE[spec]`` divisible by 16."""
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
            if ty.startswith("*") or name in DIVISIBLE[spec]}


def tasks(archs=ARCHS, dtypes=DTYPES) -> list[tuple]:
    """(arch, dtype, index into ``signatures``, specialization) of every compile; a launch that
    two dtypes share (the backward's kernels on float32 operands only) is compiled once, under
    the first dtype."""
    todo, seen = [], set()
    for arch in archs:
        for dtype in dtypes:
            for i, (fn, _, sig, const, warps, stages) in enumerate(signatures(dtype, arch)):
                key = (arch, fn.__name__, tuple(sig.items()), tuple(sorted(const.items())),
                       warps, stages)
                if key not in seen:
                    seen.add(key)
                    todo += [(arch, dtype, i, spec) for spec in SPECS]
    return todo


def compile_one(task: tuple) -> dict:
    """Compile one launch for its target; the record the tests assert on."""
    import triton

    arch, dtype, i, spec = task
    fn, name, sig, const, warps, stages = signatures(dtype, arch)[i]
    rec = {"kernel": name, "dtype": dtype, "arch": arch, "spec": spec, "num_warps": warps,
           "stages": stages, "BT": const.get("BT"), "BK": const.get("BK"), "BD": const.get("BD"),
           "triton": triton.__version__}
    return compile_record(rec, fn, sig, const, specialization(sig, spec), arch,
                          {"num_warps": warps, "num_stages": stages or 3})


def compile_all(archs=ARCHS, dtypes=DTYPES, processes: int | None = None) -> list[dict]:
    """Every record, compiled in a pool of worker processes (``triton_aot.compile_in_pool``)."""
    return compile_in_pool(compile_one, tasks(archs, dtypes), processes)


if __name__ == "__main__":
    write_records(compile_all, DTYPES, ARCHS)
