"""Ahead-of-time compilation of every kernel of ops/fwp/triton.py for real GPU targets, on a
machine without a GPU (Triton's own ptxas compiles PTX to a cubin).

Run as a script (``python tests/ops/triton_aot.py OUT.json [arch ...]``) in a process where
TRITON_INTERPRET is unset: tests/conftest.py turns the interpreter on for the test session, and
interpreted kernels cannot be compiled. Writes one record per distinct compiled kernel (kernel
variant, dtype, target, BK): the shared memory the launch needs, registers, spill bytes (from
ptxas's -v log, which Triton prints with TRITON_DUMP_PTXAS_LOG=1), or the error.

The variants are the launches the host code of ops/fwp/triton.py makes for each op (linear
attention, normalised linear attention, delta rule), forward and backward; a launch two ops share
(the same kernel, pointer dtypes and constexprs) is compiled once. The compiles run in a pool of
worker processes, one per available core, longest first.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time

DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
ARCHS = (80, 90)
BKS = (64,)  # the key tile the dispatcher uses (Dk <= 64; see triton.key_tile)
# The ops the host code runs through the kernels, as (name, has_w, U dtype, o and dO dtype):
# "x" is the input dtype, "f" float32. Linear attention passes v as U; the normalised one appends
# a column of ones to v and produces o (hence dO) in float32; the delta rule's U is float32.
OPS = (("linear", False, "x", "x"), ("linear_norm", False, "x", "f"), ("delta", True, "f", "x"))
# Relative compile cost by kernel family (measured, float32 about twice half), for the order.
COST = {"ut_bwd": 5, "grad": 2.5, "ut_fwd": 2, "state_bwd": 1.5, "output": 1.5, "state_fwd": 1,
        "local_du": 1}


def signatures(kernels, tdtype: str, dtype, arch: int, BK: int):
    """(kernel, name, signature, constexprs, num_warps) for every distinct launch the host code
    makes with these settings: the same pointer dtypes and constexprs that ``_FastWeightsTriton``
    passes (``_launch``/``tile_config``), for each op of OPS, forward and backward."""
    import torch

    cfg = kernels.tile_config(arch, BK, getattr(torch, dtype))
    if cfg is None:
        return []
    in_prec, f32_prec = kernels.precisions(getattr(torch, dtype))
    base = {"UPCAST": False, "IN_PREC": in_prec, "F32_PREC": f32_prec, "BT": kernels.BT,
            "BK": BK, "BV": cfg.BV}
    grad_consts = {"F32_PREC": f32_prec, "BT": kernels.BT, "BK": BK, "BV": cfg.BV}
    ptr = {"x": f"*{tdtype}", "f": "*fp32"}
    x, f = ptr["x"], ptr["f"]
    dims = {"T": "i32", "H": "i32", "Dk": "i32", "Dv": "i32", "C": "i32"}
    dimsN = {"T": "i32", "H": "i32", "N": "i32", "Dk": "i32", "Dv": "i32", "C": "i32"}
    out = []
    for _, has_w, u_kind, o_kind in OPS:
        u, o = ptr[u_kind], ptr[o_kind]  # U as the state pass reads it; o and dO
        w = f if has_w else x  # without W the host passes k in its place
        u0 = f if has_w else x  # the state pass's input U0: the UT solve's (float32) or v
        if has_w:  # (a) forward, and again in the backward storing Xinv
            for store_x in (False, True):
                sig = {"k_ptr": x, "v_ptr": x, "beta_ptr": f, "w_ptr": f, "u_ptr": f,
                       "x_ptr": f, **dims}
                out.append((kernels._ut_fwd_kernel, f"ut_fwd[STORE_X={store_x}]", sig,
                            {**base, "STORE_X": store_x}, cfg.num_warps))
        sig = {"k_ptr": x, "w_ptr": w, "u_ptr": u0, "s0_ptr": f, "h_ptr": f, "unew_ptr": f,
               "sT_ptr": f, **dimsN}
        out.append((kernels._state_fwd_kernel, f"state_fwd[HAS_W={has_w}]", sig,
                    {**base, "HAS_W": has_w, "STAGES": cfg.loop_stages}, cfg.num_warps))
        sig = {"q_ptr": x, "k_ptr": x, "u_ptr": u, "h_ptr": f, "o_ptr": o, **dimsN}
        out.append((kernels._output_kernel, f"output[U={u},o={o}]", sig, base, cfg.num_warps))
        sig = {"q_ptr": x, "k_ptr": x, "do_ptr": o, "du_ptr": f, **dims}
        out.append((kernels._local_du_kernel, f"local_du[dO={o}]", sig, base, cfg.num_warps))
        sig = {"q_ptr": x, "k_ptr": x, "w_ptr": w, "do_ptr": o, "du_ptr": f, "dsT_ptr": f,
               "dh_ptr": f, "ds0_ptr": f, **dimsN}
        out.append((kernels._state_bwd_kernel, f"state_bwd[HAS_W={has_w},dO={o}]", sig,
                    {**base, "HAS_W": has_w, "STAGES": cfg.loop_stages}, cfg.num_warps))
        sig = {"q_ptr": x, "k_ptr": x, "u_ptr": u, "h_ptr": f, "dh_ptr": f, "do_ptr": o,
               "dq_ptr": f, "dk_ptr": f, **dimsN}
        out.append((kernels._grad_kernel, f"grad[U={u},dO={o}]", sig, grad_consts,
                    cfg.num_warps))
        if has_w:
            sig = {"k_ptr": x, "v_ptr": x, "beta_ptr": f, "x_ptr": f, "h_ptr": f, "du_ptr": f,
                   "dk_ptr": f, "dv_ptr": f, "dbeta_ptr": f, **dimsN}
            out.append((kernels._ut_bwd_kernel, "ut_bwd", sig, grad_consts, cfg.ut_bwd_warps))
    seen, unique = set(), []
    for k, name, sig, const, warps in out:  # ops share launches; float32 inputs merge more
        key = (k.__name__, tuple(sig.items()), tuple(const.items()), warps)
        if key not in seen:
            seen.add(key)
            unique.append((k, name, sig, const, warps))
    return unique


def tasks(archs=ARCHS, dtypes=tuple(DTYPES), bks=BKS) -> list[tuple[int, str, int, int]]:
    """(arch, dtype, BK, index into ``signatures``) of every compile, the costliest first."""
    from fastweights.ops.fwp import triton as kernels

    out = []
    for arch in archs:
        for dtype in dtypes:
            for BK in bks:
                for i, (_, name, *_) in enumerate(signatures(kernels, DTYPES[dtype], dtype,
                                                             arch, BK)):
                    cost = COST[name.split("[")[0]] * (2 if dtype == "float32" else 1)
                    out.append((cost, (arch, dtype, BK, i)))
    return [task for _, task in sorted(out, key=lambda c: -c[0])]


def compile_one(task: tuple[int, str, int, int]) -> dict:
    """Compile one launch for its target; the record the tests assert on."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fastweights.ops.fwp import triton as kernels

    arch, dtype, BK, i = task
    fn, name, sig, const, warps = signatures(kernels, DTYPES[dtype], dtype, arch, BK)[i]
    rec = {"kernel": name, "dtype": dtype, "arch": arch, "BK": BK, "BV": const["BV"],
           "num_warps": warps}
    start = time.perf_counter()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                                target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        text = log.getvalue()
        rec["shared"] = ck.metadata.shared
        spills = [int(a) + int(b) for a, b in re.findall(
            r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)]
        regs = [int(r) for r in re.findall(r"Used (\d+) registers", text)]
        rec["spill_bytes"] = max(spills) if spills else None
        rec["registers"] = max(regs) if regs else None
        rec["has_cubin"] = bool(ck.asm.get("cubin"))
    except Exception as exc:  # recorded, and asserted on by the tests
        rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
    rec["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(rec), file=sys.stderr, flush=True)
    return rec


def _init_worker(cache_dir: str) -> None:
    import triton

    # ptxas's log (registers, spills) is printed only when ptxas runs: a fresh cache, no hits
    # (every task is a distinct kernel, so nothing is lost).
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    triton.knobs.cache.dir = cache_dir
    triton.knobs.nvidia.dump_ptxas_log = True


def workers() -> int:
    """One compile process per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def compile_all(archs=ARCHS, dtypes=tuple(DTYPES), bks=BKS, processes: int | None = None,
                ) -> list[dict]:
    """Every record, compiled in ``processes`` (default ``workers()``) worker processes."""
    todo = tasks(archs, dtypes, bks)
    cache_dir = tempfile.mkdtemp(prefix="fastweights-aot-")
    processes = min(processes or workers(), len(todo))
    if processes == 1:
        _init_worker(cache_dir)
        return [compile_one(t) for t in todo]
    # spawn: fresh interpreters (no state of an imported torch forked into them)
    with multiprocessing.get_context("spawn").Pool(processes, _init_worker, (cache_dir,)) as pool:
        return list(pool.imap_unordered(compile_one, todo, chunksize=1))


if __name__ == "__main__":
    archs = tuple(int(a) for a in sys.argv[2:]) or ARCHS
    result = compile_all(archs)
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh)
