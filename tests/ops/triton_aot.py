"""Ahead-of-time compilation of every kernel of ops/fwp/triton.py for real GPU targets, on a
machine without a GPU (Triton's own ptxas compiles PTX to a cubin).

Run as a script (``python tests/ops/triton_aot.py OUT.json [arch ...]``) in a process where
TRITON_INTERPRET is unset: tests/conftest.py turns the interpreter on for the test session, and
interpreted kernels cannot be compiled. Writes one record per (kernel, dtype, target, BK):
the shared memory the launch needs, registers, spill bytes (from ptxas's -v log, which
Triton prints with TRITON_DUMP_PTXAS_LOG=1), or the error.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time

DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
ARCHS = (80, 90)
BKS = (64,)  # the key tile the dispatcher uses (Dk <= 64; see triton.key_tile)


def signatures(kernels, tdtype: str, dtype, arch: int, BK: int):
    """(kernel, signature, constexprs) for every launch the host code makes with these
    settings: the same constexprs the dispatcher passes (``_launch``/``tile_config``)."""
    import torch

    cfg = kernels.tile_config(arch, BK, getattr(torch, dtype))
    if cfg is None:
        return []
    in_prec, f32_prec = kernels.precisions(getattr(torch, dtype))
    base = {"UPCAST": False, "IN_PREC": in_prec, "F32_PREC": f32_prec, "BT": kernels.BT,
            "BK": BK, "BV": cfg.BV}
    x, f = f"*{tdtype}", "*fp32"
    dims = {"T": "i32", "H": "i32", "Dk": "i32", "Dv": "i32", "C": "i32"}
    dimsN = {"T": "i32", "H": "i32", "N": "i32", "Dk": "i32", "Dv": "i32", "C": "i32"}
    out = []
    for store_x in (False, True):
        sig = {"k_ptr": x, "v_ptr": x, "beta_ptr": f, "w_ptr": f, "u_ptr": f, "x_ptr": f, **dims}
        out.append((kernels._ut_fwd_kernel, f"ut_fwd[STORE_X={store_x}]", sig,
                    {**base, "STORE_X": store_x}))
    for has_w in (False, True):
        sig = {"k_ptr": x, "w_ptr": f if has_w else x, "u_ptr": f if has_w else x, "s0_ptr": f,
               "h_ptr": f, "unew_ptr": f, "sT_ptr": f, **dimsN}
        out.append((kernels._state_fwd_kernel, f"state_fwd[HAS_W={has_w}]", sig,
                    {**base, "HAS_W": has_w, "STAGES": cfg.loop_stages}))
        # linear attention: U is v (input dtype), o in the input dtype, or float32 (normalize)
        for u, o in ((f, x),) if has_w else ((x, x), (x, f)):
            sig = {"q_ptr": x, "k_ptr": x, "u_ptr": u, "h_ptr": f, "o_ptr": o, **dimsN}
            out.append((kernels._output_kernel, f"output[U={u},o={o}]", sig, base))
    for do in (x, f):  # dO in the input dtype, or float32 (normalised linear attention)
        sig = {"q_ptr": x, "k_ptr": x, "do_ptr": do, "du_ptr": f, **dims}
        out.append((kernels._local_du_kernel, f"local_du[dO={do}]", sig, base))
        for has_w in (False, True):
            if has_w and do == f:
                continue
            sig = {"q_ptr": x, "k_ptr": x, "w_ptr": f if has_w else x, "do_ptr": do,
                   "du_ptr": f, "dsT_ptr": f, "dh_ptr": f, "ds0_ptr": f, **dimsN}
            out.append((kernels._state_bwd_kernel, f"state_bwd[HAS_W={has_w},dO={do}]", sig,
                        {**base, "HAS_W": has_w, "STAGES": cfg.loop_stages}))
    g = {"F32_PREC": f32_prec, "BT": kernels.BT, "BK": BK, "BV": cfg.BV}
    for u in (x, f):
        for do in (x, f):
            sig = {"q_ptr": x, "k_ptr": x, "u_ptr": u, "h_ptr": f, "dh_ptr": f, "do_ptr": do,
                   "dq_ptr": f, "dk_ptr": f, **dimsN}
            out.append((kernels._grad_kernel, f"grad[U={u},dO={do}]", sig, g))
    sig = {"k_ptr": x, "v_ptr": x, "beta_ptr": f, "x_ptr": f, "h_ptr": f, "du_ptr": f,
           "dk_ptr": f, "dv_ptr": f, "dbeta_ptr": f, **dimsN}
    out.append((kernels._ut_bwd_kernel, "ut_bwd", sig, {**g, "num_warps": cfg.ut_bwd_warps}))
    seen, unique = set(), []
    for k, name, sig, const in out:  # float32 inputs make some variants the same kernel
        key = (k.__name__, tuple(sig.items()), tuple(const.items()))
        if key not in seen:
            seen.add(key)
            const = dict(const)
            unique.append((k, name, sig, const, const.pop("num_warps", cfg.num_warps)))
    return unique


def compile_all(archs=ARCHS, dtypes=tuple(DTYPES), bks=BKS) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fastweights.ops.fwp import triton as kernels

    # ptxas's log (registers, spills) is printed only when ptxas runs: no cache hits.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastweights-aot-")
    triton.knobs.cache.dir = os.environ["TRITON_CACHE_DIR"]
    triton.knobs.nvidia.dump_ptxas_log = True
    records = []
    for arch in archs:
        for dtype in dtypes:
            for BK in bks:
                for fn, name, sig, const, warps in signatures(kernels, DTYPES[dtype], dtype, arch,
                                                             BK):
                    rec = {"kernel": name, "dtype": dtype, "arch": arch, "BK": BK,
                           "BV": const["BV"], "num_warps": warps}
                    start = time.perf_counter()
                    log = io.StringIO()
                    try:
                        with contextlib.redirect_stdout(log):
                            ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                                                target=GPUTarget("cuda", arch, 32),
                                                options={"num_warps": warps})
                        text = log.getvalue()
                        rec["shared"] = ck.metadata.shared
                        spills = [int(a) + int(b) for a, b in re.findall(
                            r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)]
                        regs = [int(r) for r in re.findall(r"Used (\d+) registers", text)]
                        rec["spill_bytes"] = max(spills) if spills else None
                        rec["registers"] = max(regs) if regs else None
                        rec["has_cubin"] = bool(ck.asm.get("cubin"))
                    except Exception as exc:  # noqa: BLE001 - recorded and asserted on by the tests
                        rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
                    rec["seconds"] = round(time.perf_counter() - start, 2)
                    records.append(rec)
                    print(json.dumps(rec), file=sys.stderr, flush=True)
    return records


if __name__ == "__main__":
    archs = tuple(int(a) for a in sys.argv[2:]) or ARCHS
    result = compile_all(archs)
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh)
