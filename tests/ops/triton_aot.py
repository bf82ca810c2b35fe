"""Ahead-of-time compilation of every kernel of ops/delta_rule/triton.py (the fast-weight ops'
kernels) for real GPU targets, on a machine without a GPU (Triton's own ptxas compiles PTX to a
cubin).

Run as a script (``python tests/ops/triton_aot.py OUT.json [--ttt | --ttt-full]
[--only=FAMILY,...] [arch ...]``)
in a process where
TRITON_INTERPRET is unset: tests/conftest.py turns the interpreter on for the test session, and
interpreted kernels cannot be compiled. Writes one record per compile (kernel variant, dtype,
target, specialisation): the shared memory the launch needs, registers, spill bytes (from
ptxas's -v log, which Triton prints with TRITON_DUMP_PTXAS_LOG=1), or the error.

The variants are recorded from the host code itself: ``_FastWeightsTriton`` runs forward and
backward on small CPU tensors for each op (linear attention, normalised linear attention, delta
rule) and head size (one and two key blocks) with its kernels replaced by recorders, so the
compiled launches are exactly the ones it makes (grids aside); a launch two ops share (the same
kernel, pointer dtypes, constexprs and warps) is compiled once. Each is compiled twice: without
argument attributes and with the alignment/divisibility ones of the usual training shapes. The
compiles run in a pool of worker processes, one per available core, longest first.
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
from collections.abc import Callable

DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
ARCHS = (80, 90)
DKS = (64, 128)  # head sizes that cover every launch: one key block, two key blocks
# The ops the host code runs through the kernels: linear attention, normalised linear attention
# (v gains a column of ones, o and dO are float32), the delta rule, the gated delta rule (the
# delta rule's kernels with HAS_G on).
OPS = ("linear", "linear_norm", "delta", "gated")
# Triton specialises each launch on its arguments (16-byte alignment, integers divisible by 16).
# The host code pads head sizes to multiples of 16 and aligns every tensor (delta_rule/triton.py
# ``_prepare``), so only the sizes T, N (chunks) and C (the chunk size) vary: the two ends of that
# range are compiled, see ``specialization``.
SPECS = ("odd_T", "aligned")
# The aligned specialisation is compiled for bfloat16 (the usual training dtype; float16 kernels
# are the same code with another input element type) and float32 (other kernels): the compile
# budget of the test session.
ALIGNED_DTYPES = ("bfloat16", "float32")
# Relative compile cost by kernel family (measured, float32 about twice half), for the order.
COST = {"ut_bwd": 3, "grad": 2.5, "ut_fwd": 2, "state_bwd": 1.5, "output": 1.5, "state_fwd": 1,
        "local_du": 1, "linear_bwd_b": 3, "linear_bwd_a": 2, "linear_fwd": 1.5,
        "linear_bwd_c": 1, "qk": 0.3, "mlp_fwd": 3, "mlp_recompute": 3, "mlp_bwd_a": 3,
        "mlp_bwd_b": 3, "linear_decode": 0.5, "mlp_decode": 1, "linear_fwd_regs": 1.5, "linear_fwd_res": 1.5,
        "linear_bwd_a_res": 2, "linear_bwd_b_res": 3}
# TTT: (dtype, head size, flags, specialisation). "all": bias, LayerNorm with bias, residual
# (the layers' default); "none": none of them. The first two are the target shapes (--ttt).
# The dispatcher sends head sizes that are multiples of 16 only, so a TTT launch is "aligned"
# or, for a T that is not a multiple of 16, "odd_T".
TTT_FLAGS = {"all": (True, True, True, True), "none": (False, False, False, False)}
TTT_CASES = (("bfloat16", 128, "all", "aligned"), ("bfloat16", 128, "none", "aligned"),
             ("bfloat16", 64, "all", "aligned"), ("bfloat16", 64, "none", "aligned"),
             ("bfloat16", 128, "all", "odd_T"), ("bfloat16", 64, "none", "odd_T"),
             ("float16", 128, "all", "odd_T"), ("float16", 64, "all", "odd_T"))


class _Recorder:
    """Stands in for a @triton.jit kernel: records what the host code launches it with."""

    def __init__(self, fn, out: list):
        self.fn, self.out = fn, out

    def __getitem__(self, grid):
        from triton.runtime.jit import mangle_type

        def launch(*args, num_warps: int, num_stages: int | None = None, **constexprs):
            sig = {}
            for name, arg in zip(self.fn.arg_names, args):
                # Triton's own argument types, unspecialised (no constexpr for an int equal to 1)
                sig[name] = mangle_type(arg)
            self.out.append((self.fn, sig, constexprs, num_warps, num_stages))
        return launch


class _Ctx:
    """Stands in for an autograd.Function's ctx."""

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


@contextlib.contextmanager
def recorded(modules, arch: int):
    """Within: every ``_*_kernel`` of ``modules`` replaced by a ``_Recorder`` and their
    ``_arch`` returning ``arch``; yields the list the launches are recorded into."""
    out: list = []
    names = [(m, n) for m in modules for n in vars(m)
             if n.startswith("_") and n.endswith("_kernel")]
    saved = {(m, n): getattr(m, n) for m, n in names}
    saved_arch = [m._arch for m in modules]
    try:
        for m, n in names:
            setattr(m, n, _Recorder(saved[m, n], out))
        for m in modules:
            m._arch = lambda device: arch
        yield out
    finally:
        for m, n in names:
            setattr(m, n, saved[m, n])
        for m, a in zip(modules, saved_arch):
            m._arch = a


def _run_host(kernels, op: str, dtype, Dk: int, out: list) -> None:
    """One forward and backward of ``op`` through the host code of ops/*/triton.py on small
    CPU tensors, every kernel launch recorded into ``out`` instead of run."""
    import torch

    B, T, H, Dv = 1, 5, 1, 8
    q, k = (torch.zeros(B, T, H, Dk, dtype=dtype) for _ in range(2))
    v = torch.zeros(B, T, H, Dv, dtype=dtype)
    if op == "gated":  # one value head per key head, and grouped heads (two per key head)
        from fastweights.ops.gated_delta_rule import triton as gated

        for Hv in (1, 2):
            v, gates = torch.zeros(B, T, Hv, Dv, dtype=dtype), torch.zeros(2, B, T, Hv)
            S0 = torch.zeros(B * Hv, Dk, Dv)
            ctx = _Ctx()
            o, _ = gated._GatedDeltaTriton.forward(ctx, q, k, v, *gates, S0, 4)
            gated._GatedDeltaTriton.backward(ctx, torch.zeros_like(o), torch.zeros_like(S0))
        return
    beta = torch.zeros(B, T, H, dtype=dtype) if op == "delta" else None
    S0 = torch.zeros(B * H, Dk, Dv + (op == "linear_norm"), dtype=torch.float32)
    if op == "linear_norm":  # linear_attn_triton's normalisation: a column of ones on v
        v = torch.cat([v, v.new_ones(B, T, H, 1)], dim=-1)
    ctx = _Ctx()
    fwd = kernels._FastWeightsTriton
    out_dtype = torch.float32 if op == "linear_norm" else dtype
    beta32 = None if beta is None else beta.to(torch.float32)
    o, _ = fwd.forward(ctx, q, k, v, beta32, S0, 4, out_dtype)
    fwd.backward(ctx, torch.zeros_like(o), torch.zeros_like(S0))


def signatures(kernels, dtype: str, arch: int):
    """(kernel, name, signature, constexprs, num_warps) of every distinct launch the host code
    makes for ``dtype`` on sm_``arch``: the ops of OPS at each Dk of DKS, forward and backward,
    recorded from ``_FastWeightsTriton`` itself (launch shapes, pointer dtypes, constexprs and
    warps exactly as it passes them). Integer arguments compile unspecialised (i32)."""
    import torch

    with recorded((kernels,), arch) as out:
        for op in OPS:
            name = {"delta": "delta_rule", "gated": "gated_delta_rule"}.get(op, "linear_attn")
            if not kernels.supports(name, getattr(torch, dtype)):
                continue  # the dispatcher does not launch it (float32 delta rule)
            for Dk in DKS:
                _run_host(kernels, op, getattr(torch, dtype), Dk, out)
    seen, unique = set(), []
    for fn, sig, const, warps, _ in out:  # ops and head sizes share launches
        key = (fn.__name__, tuple(sig.items()), tuple(sorted(const.items())), warps)
        if key not in seen:
            seen.add(key)
            unique.append((fn, _name(fn.__name__, sig, const), sig, const, warps))
    return unique


def _run_ttt_host(kernels, dtype, D: int, flags: str) -> None:
    """One forward and backward of ``_LinearTriton`` (ops/ttt/triton.py; the forward with
    each kernel, ops/ttt/triton_regs.py and triton_resident.py) and of ``_MLPTriton``, and decoding steps of each
    (ops/ttt/triton_decode.py) on small CPU tensors (kernels
    replaced by recorders): b = 16, T = b + 3, the flags of ``TTT_FLAGS[flags]``."""
    import torch

    bias, ln, ln_bias, residual = TTT_FLAGS[flags]
    B, H, b = 1, 1, 16
    T = b + 3
    q = torch.zeros(B, T, H, D, dtype=dtype)
    f = torch.zeros
    # TTT-Linear with each forward kernel (ops/ttt/triton_regs.py: the streamed one, the
    # dispatcher's default, the register-resident one where it has a tiling, then the opt-in
    # resident one of ops/ttt/triton_resident.py)
    from fastweights.ops.ttt import triton_regs, triton_resident

    saved = os.environ.pop(triton_regs.ENV, None)
    try:
        for variant in ("stream", "", "resident"):
            os.environ[triton_regs.ENV] = variant
            ctx = _Ctx()
            ctx.needs_input_grad = (True,) * 11
            res = kernels._LinearTriton.forward(
                ctx, q, q, q, f(B, T, H), torch.ones(H, b), f(H, D) if ln else None,
                f(H, D) if ln_bias else None, f(B * H, D, D), f(B * H, D) if bias else None,
                residual, None)
            if variant == "stream":  # the backward once (it does not depend on the forward)
                kernels._LinearTriton.backward(ctx, *(torch.zeros_like(r) for r in res))
                if triton_resident._arch(q.device) >= triton_resident.BWD_MIN_ARCH:
                    # and with the resident backward kernels (FASTWEIGHTS_TTT_BWD=resident)
                    os.environ[triton_resident.BWD_ENV] = triton_resident.VARIANT
                    try:
                        kernels._LinearTriton.backward(ctx, *(torch.zeros_like(r) for r in res))
                    finally:
                        os.environ.pop(triton_resident.BWD_ENV)
    finally:
        os.environ.pop(triton_regs.ENV)
        if saved is not None:
            os.environ[triton_regs.ENV] = saved
    # TTT-MLP, forward and backward (two full mini-batches and a partial one: the recompute
    # kernel runs, and both variants of the backward kernel)
    Dh = 4 * D
    T2 = 2 * b + 3
    q2 = torch.zeros(B, T2, H, D, dtype=dtype)
    ctx = _Ctx()
    ctx.needs_input_grad = (True,) * 13
    res = kernels._MLPTriton.forward(
        ctx, q2, q2, q2, f(B, T2, H), torch.ones(H, b), f(H, D) if ln else None,
        f(H, D) if ln_bias else None, f(B * H, D, Dh), f(B * H, Dh) if bias else None,
        f(B * H, Dh, D), f(B * H, D) if bias else None, residual, None)
    kernels._MLPTriton.backward(ctx, *(torch.zeros_like(r) for r in res))
    # The TTT-Linear decoding step (ops/ttt/triton_decode.py): a step inside a mini-batch and
    # one that completes it
    from fastweights.ops.ttt import triton_decode
    from fastweights.ops.ttt.common import TTTState

    for pos in (1, b - 1):
        rows = (f(B, H, pos, D), f(B, H, pos, D))
        carry = TTTState((f(B, H, D, D), f(B, H, D) if bias else None), rows, pos)
        triton_decode.ttt_linear_decode_triton(
            q[:, :1], q[:, :1], q[:, :1], f(B, 1, H, dtype=dtype), carry,
            f(H, D) if ln else None, f(H, D) if ln_bias else None, residual, torch.ones(H, b))
    # TTT-MLP's, whose row tiles grow with b: also at the largest mini-batch the kernel takes
    start = (f(B, H, D, Dh), f(B, H, Dh) if bias else None, f(B, H, Dh, D),
             f(B, H, D) if bias else None)
    for bd in (b, triton_decode.MAX_MINI_BATCH):
        for pos in (1, bd - 1):
            rows = tuple(f(B, H, pos, n) for n in (D, Dh, Dh, D))
            triton_decode.ttt_mlp_decode_triton(
                q[:, :1], q[:, :1], q[:, :1], f(B, 1, H, dtype=dtype),
                TTTState(start, rows, pos), f(H, D) if ln else None,
                f(H, D) if ln_bias else None, residual, torch.ones(H, bd))


def ttt_signatures(kernels, case: tuple, arch: int):
    """(kernel, name, signature, constexprs, num_warps, num_stages) of every distinct launch
    of one case of TTT_CASES on sm_``arch``, recorded from the host code."""
    import torch

    from fastweights.ops.ttt import triton_decode, triton_regs, triton_resident

    dtype, D, flags, _ = case
    with recorded((kernels, triton_decode, triton_regs, triton_resident), arch) as out:
        _run_ttt_host(kernels, getattr(torch, dtype), D, flags)
    return distinct(out, lambda const: "".join(f"[{flag}]" for flag in ("TAIL", "COMMIT")
                                               if const.get(flag)))


def distinct(out: list, label) -> list:
    """(kernel, name, signature, constexprs, num_warps, num_stages) of each distinct recorded
    launch, named by its kernel family and ``label(constexprs)``."""
    seen, unique = set(), []
    for fn, sig, const, warps, stages in out:
        key = (fn.__name__, tuple(sig.items()), tuple(sorted(const.items())), warps, stages)
        if key not in seen:
            seen.add(key)
            name = fn.__name__.strip("_").removesuffix("_kernel") + label(const)
            unique.append((fn, name, sig, const, warps, stages))
    return unique


def dispatched(ttt_kernels, name: str) -> bool:
    """Whether the dispatcher sends launches of the TTT kernel ``name``: not the backward
    kernels of ops outside ops/ttt/triton.py's ``BACKWARD_OPS`` (none today: TTT-MLP's were,
    before they were split into spill-free kernels), which are not compiled here."""
    return not (name.startswith("mlp_bwd") and "ttt_mlp" not in ttt_kernels.BACKWARD_OPS)


def _name(kernel: str, sig: dict, const: dict) -> str:
    """A record's name: the kernel family and what tells its launches apart (flags, NK, and the
    pointer dtypes that differ between ops)."""
    family = kernel.strip("_").removesuffix("_kernel")
    parts = [f"{k}={const[k]}" for k in ("HAS_W", "NK") if k in const]
    parts += [flag for flag in ("HAS_G", "GROUPED") if const.get(flag)]
    parts += [f"{p[:-4]}={sig[p]}" for p in ("u_ptr", "o_ptr", "do_ptr") if p in sig
              and family in ("output", "local_du", "state_bwd", "grad")]
    return f"{family}[{','.join(parts)}]" if parts else family


def specialization(sig: dict, spec: str) -> dict:
    """Triton's argument attributes for a launch: "aligned" what a launch gets whose pointers
    are 16-byte aligned and whose sizes T, N, Dk, Dv, C (Dh) are multiples of 16 (the usual
    training shapes; H is left free); "odd_T" the same but for the sizes along time, T, N and C
    (any sequence length and chunk size). The host code never launches anything less aligned:
    the fast-weight ops pad head sizes to multiples of 16 (delta_rule/triton.py ``_prepare``),
    the TTT dispatcher takes only such head sizes."""
    sizes = ("Dk", "Dv", "Dh") if spec == "odd_T" else ("T", "N", "Dk", "Dv", "C", "Dh")
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
            if ty.startswith("*") or name in sizes}


def tasks(archs=ARCHS, dtypes=tuple(DTYPES), ttt: tuple = (), only: tuple = ()) -> list[tuple]:
    """(arch, dtype, index into ``signatures``, specialization) of every compile, the costliest
    first; with ``ttt`` (cases of TTT_CASES) ("ttt", arch, case, index into
    ``ttt_signatures``) of the TTT kernels instead, ``only`` those of the kernel families
    named (all if empty)."""
    if ttt:
        from fastweights.ops.ttt import triton as ttt_kernels

        # A launch whose kernel has no T or N argument (the decoding step) compiles to the same
        # program under "odd_T" as under "aligned": compiled once (a second compile would be a
        # cache hit, which prints no ptxas log).
        todo, seen = [], set()
        for arch in archs:
            for case in ttt:
                for i, (_, name, sig, const, warps, stages) in enumerate(
                        ttt_signatures(ttt_kernels, case, arch)):
                    key = (arch, name, tuple(sig.items()), tuple(sorted(const.items())), warps,
                           stages, tuple(sorted(specialization(sig, case[3]))))
                    if only and name.split("[")[0] not in only:
                        continue
                    if dispatched(ttt_kernels, name) and key not in seen:
                        seen.add(key)
                        todo.append((COST[name.split("[")[0]], ("ttt", arch, case, i)))
        return [task for _, task in sorted(todo, key=lambda c: -c[0])]
    from fastweights.ops.delta_rule import triton as kernels

    out = []
    for arch in archs:
        for dtype in dtypes:
            for i, (_, name, *_) in enumerate(signatures(kernels, dtype, arch)):
                cost = COST[name.split("[")[0]] * (2 if dtype == "float32" else 1)
                for spec in SPECS:
                    if spec == "aligned" and dtype not in ALIGNED_DTYPES:
                        continue
                    out.append((cost, (arch, dtype, i, spec)))
    return [task for _, task in sorted(out, key=lambda c: -c[0])]


def compile_one(task: tuple[int, str, int, int]) -> dict:
    """Compile one launch for its target; the record the tests assert on."""
    if task[0] == "ttt":
        from fastweights.ops.ttt import triton as ttt_kernels

        _, arch, case, i = task
        fn, name, sig, const, warps, stages = ttt_signatures(ttt_kernels, case, arch)[i]
        dtype, D, flags, spec = case
        rec = {"kernel": name, "dtype": dtype, "arch": arch, "spec": spec, "D": D,
               "flags": flags, "BV": const.get("BV"), "BK": const["BK"], "num_warps": warps,
               "stages": stages}
        options = {"num_warps": warps, "num_stages": stages}
    else:
        from fastweights.ops.delta_rule import triton as kernels

        arch, dtype, i, spec = task
        fn, name, sig, const, warps = signatures(kernels, dtype, arch)[i]
        rec = {"kernel": name, "dtype": dtype, "arch": arch, "spec": spec, "BV": const["BV"],
               "BK": const["BK"], "num_warps": warps, "stages": const.get("STAGES")}
        options = {"num_warps": warps}
    return compile_record(rec, fn, sig, const, specialization(sig, spec), arch, options)


def compile_record(rec: dict, fn, sig: dict, const: dict, attrs: dict, arch: int,
                   options: dict) -> dict:
    """``rec`` completed with one compile's figures (shared memory, registers and spill bytes
    from ptxas's log, whether there is a cubin, or the error) and printed to stderr."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                                target=GPUTarget("cuda", arch, 32), options=options)
        text = log.getvalue()
        rec["shared"] = ck.metadata.shared
        spills = [int(a) + int(b) for a, b in re.findall(
            r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)]
        regs = [int(r) for r in re.findall(r"Used (\d+) registers", text)]
        rec["spill_bytes"] = max(spills) if spills else None
        rec["registers"] = max(regs) if regs else None
        rec["has_cubin"] = bool(ck.asm.get("cubin"))
    except Exception as exc:  # recorded, and asserted on by the tests
        rec["error"] = f"{type(exc).__name__}: {exc}"[-1500:]
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


def compile_all(archs=ARCHS, dtypes=tuple(DTYPES), processes: int | None = None,
                ttt: tuple = (), only: tuple = ()) -> list[dict]:
    """Every record, compiled in ``processes`` (default ``workers()``) worker processes
    (``ttt``: the TTT kernels' cases instead, ``only`` some of their families, see
    ``tasks``)."""
    return compile_in_pool(compile_one, tasks(archs, dtypes, ttt, only), processes)


def compile_in_pool(compile_task, todo: list, processes: int | None = None) -> list[dict]:
    """``compile_task`` (a module-level function) over ``todo`` in ``processes`` (default
    ``workers()``) worker processes sharing one fresh Triton cache."""
    cache_dir = tempfile.mkdtemp(prefix="fastweights-aot-")
    processes = min(processes or workers(), len(todo))
    if processes == 1:
        _init_worker(cache_dir)
        return [compile_task(t) for t in todo]
    # spawn: fresh interpreters (no state of an imported torch forked into them)
    with multiprocessing.get_context("spawn").Pool(processes, _init_worker, (cache_dir,)) as pool:
        return list(pool.imap_unordered(compile_task, todo, chunksize=1))


def record_problems(r: dict, name: str, shared_limit: int) -> list[str]:
    """What is wrong with one compile record (named ``name`` in the messages): an error, no
    cubin, shared memory over ``shared_limit`` bytes, no ptxas log, spills."""
    if "error" in r:
        return [f"{name}: {r['error']}"]
    problems = [] if r["has_cubin"] else [f"{name}: no cubin"]
    if r["shared"] > shared_limit:
        problems.append(f"{name}: {r['shared']} B shared > {shared_limit} B")
    if r["spill_bytes"] is None:
        problems.append(f"{name}: no ptxas log (spills unknown)")
    elif r["spill_bytes"] != 0:
        problems.append(f"{name}: spills {r['spill_bytes']} B ({r['registers']} registers)")
    return problems


def write_records(compile_all: Callable[[tuple, tuple], list[dict]], dtypes: tuple,
                  archs: tuple) -> None:
    """The command line of the other kernels' compile scripts (triton_aot_aft.py,
    triton_aot_fused.py): ``OUT [DTYPE,...] [ARCH ...]`` (defaults ``dtypes``, ``archs``), every
    record of ``compile_all(archs, dtypes)`` written to OUT as JSON."""
    dtypes = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else dtypes
    archs = tuple(int(a) for a in sys.argv[3:]) or archs
    result = compile_all(archs, dtypes)
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    # --only=FAMILY[,FAMILY...]: with --ttt or --ttt-full, only those kernel families (e.g.
    # --only=linear_fwd_res, to read one kernel's registers under several Tritons)
    only = tuple(f for a in sys.argv[2:] if a.startswith("--only=")
                 for f in a.removeprefix("--only=").split(","))
    flags = [a for a in sys.argv[2:] if a.startswith("--") and not a.startswith("--only=")]
    archs = tuple(int(a) for a in sys.argv[2:] if not a.startswith("--")) or ARCHS
    cases = {"--ttt": TTT_CASES[:2], "--ttt-full": TTT_CASES}[flags[0]] if flags else ()
    result = compile_all(archs, ttt=cases, only=only)
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh)
