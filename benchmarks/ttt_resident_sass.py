"""A latency estimate of one mini-batch of TTT-Linear's resident forward, or of one of its
resident backward kernels (ops/ttt/triton_resident.py, ``--kernel``), from its SASS, without a GPU (docs/gpu_ttt_kernels.md, "Weights resident, half-precision products").

Compiles the kernel ahead of time for sm_90 exactly as the host launches it (recorded by
tests/ops/triton_aot.py), disassembles the cubin with the cuobjdump shipped in the triton wheel,
finds the loop over mini-batches (the backward branch around the wgmma instructions), counts its
instructions by kind, and walks one iteration's common path (the checkpoint store, taken once
every 16 mini-batches, is counted apart) through an in-order model of one warp:

- every instruction costs ``issue`` cycles: the warps sharing a scheduler (8 warps on 4
  schedulers at head dim 128: 2; 4 warps at 64: 1) take turns;
- an instruction that reads a register waits until the instruction writing it is done: ALU 4
  cycles, MUFU 20, SHFL 25, LDS/LDSM 30, LDG ``mem`` (the mini-batch's inputs: HBM without
  prefetching; L2 on a hit; rows a kernel reads back after storing them, L2: ``READS_BACK``);
- BAR.SYNC costs ``bar`` cycles, MEMBAR ``membar``; WARPGROUP.DEPBAR waits for the wgmma
  issued before it, ``wgmma`` cycles after its issue (per shape).

The latencies are published microbenchmark figures for Hopper rounded, given as a low and a
high set; ``benchmarks/ttt_sync_micro.py`` measures the barrier and reduction costs on the
first GPU run. Run from the repository root:

    PYTHONPATH=src python benchmarks/ttt_resident_sass.py [--D 128] [--flags all] [--stages 1]
        [--kernel linear_fwd_res | linear_bwd_a_res | linear_bwd_b_res]

Prints the instruction counts of the loop and the estimated cycles and microseconds per
mini-batch (at 1.755 GHz, the H100 SXM boost clock; an H200 boosts to 1.98 GHz).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLOCK_GHZ = 1.755

# (low, high) latencies in cycles
LAT = {
    "alu": (4, 5), "mufu": (18, 24), "shfl": (23, 30), "lds": (29, 35), "bar": (20, 40),
    "membar": (10, 30), "mem_hbm": (500, 800), "mem_l2": (250, 300),
    "wgmma_n16": (30, 60), "wgmma_n32": (35, 70), "wgmma_n128": (60, 128),
}


# the forward, the backward's recompute/read-out kernel, the backward's sequential pass
KERNELS = ("linear_fwd_res", "linear_bwd_a_res", "linear_bwd_b_res")
# Kernels whose global loads after the first wgmma of a mini-batch read back what they stored
# earlier in it (the recompute/read-out kernel's scores' gradient reads its G and dZbar rows):
# those take L2's latency whatever ``mem`` is.
READS_BACK = ("linear_bwd_a_res",)


def compile_sass(D: int, flags: str, stages: int, kernel: str = KERNELS[0], arch: int = 90
                 ) -> str:
    """The SASS of ``kernel`` (one of KERNELS) as the host launches it for a bfloat16 case of
    tests/ops/triton_aot.py (head size D, ``flags`` "all" or "none", aligned), with ``stages``
    software-pipelining stages (the forward's)."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fastweights.ops.ttt import triton as ttt_kernels
    from tests.ops.triton_aot import specialization, ttt_signatures

    case = ("bfloat16", D, flags, "aligned")
    launches = [s for s in ttt_signatures(ttt_kernels, case, arch) if s[1] == kernel]
    fn, _, sig, const, warps, _ = launches[0]
    if "STAGES" in const:
        const = {**const, "STAGES": stages}
    cache = tempfile.mkdtemp(prefix="ttt-sass-")
    os.environ["TRITON_CACHE_DIR"] = cache
    triton.knobs.cache.dir = cache
    with contextlib.redirect_stdout(io.StringIO()):
        ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const,
                                      attrs=specialization(sig, "aligned")),
                            target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": warps, "num_stages": stages})
    cubin = Path(cache) / "k.cubin"
    cubin.write_bytes(ck.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout


def parse(sass: str) -> list[tuple[int, str, str]]:
    """(address, predicate-free instruction, opcode) of every instruction."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            text = re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip())
            out.append((int(m.group(1), 16), text, text.split()[0]))
    return out


def main_loop(ins: list) -> tuple[int, int]:
    """The address range of the loop over mini-batches: the widest backward branch."""
    best = None
    for a, text, op in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if op == "BRA" and m and int(m.group(1), 16) < a:
            lo = int(m.group(1), 16)
            if best is None or a - lo > best[1] - best[0]:
                best = (lo, a)
    assert best is not None, "no loop found"
    return best


def forward_branches(ins: list, lo: int, hi: int) -> list[tuple[int, int, list[str]]]:
    """Forward branches inside the loop [lo, hi]: (the first address they skip, the target,
    the opcodes skipped)."""
    out = []
    for a, text, op in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if op == "BRA" and m and lo <= a < hi and int(m.group(1), 16) > a:
            end = int(m.group(1), 16)
            out.append((a + 16, end, [o for b, _, o in ins if a < b < end]))
    return out


def skipped_regions(ins: list, lo: int, hi: int) -> list[tuple[int, int]]:
    """Forward conditional branches inside the loop over a region with global stores and no
    wgmma (the checkpoint store): the common path skips them."""
    return [(s, e) for s, e, body in forward_branches(ins, lo, hi)
            if any(o.startswith("STG") for o in body) and not any("GMMA" in o for o in body)]


REG = re.compile(r"\bR(\d+)\b")


def _regs(text: str) -> tuple[list[int], list[int]]:
    """(destination registers, source registers) of an instruction (vector forms widened)."""
    parts = text.split(None, 1)
    if len(parts) < 2:
        return [], []
    ops = [p.strip() for p in parts[1].split(",")]
    width = 4 if ".128" in parts[0] else 2 if ".64" in parts[0] else 1

    def regs(s: str, w: int) -> list[int]:
        return [int(r) + i for r in REG.findall(s) for i in range(w)]

    if parts[0].startswith(("STG", "STS", "ST.", "BAR", "MEMBAR", "WARPGROUP", "BRA")):
        return [], regs(",".join(ops), width)
    if parts[0].startswith("HGMMA"):
        return [], []  # accumulators are waited on through WARPGROUP.DEPBAR
    if not REG.search(ops[0]) and len(ops) > 1:  # a predicate first (SHFL PT, R1, ...)
        ops = ops[1:]
    return regs(ops[0], width), regs(",".join(ops[1:]), 1)


def latency(op: str, level: int, mem: str) -> int:
    if op.startswith("LDG"):
        return LAT[f"mem_{mem}"][level]
    if op.startswith(("LDS", "LDSM")):
        return LAT["lds"][level]
    if op.startswith("SHFL"):
        return LAT["shfl"][level]
    if op.startswith("MUFU"):
        return LAT["mufu"][level]
    return LAT["alu"][level]


def _kind(op: str) -> str:
    for prefix, kind in (("LDG", "LDG"), ("LDS", "LDS"), ("SHFL", "SHFL"), ("MUFU", "MUFU"),
                         ("BAR", "BAR"), ("MEMBAR", "MEMBAR"), ("WARPGROUP.DEPBAR", "wgmma")):
        if op.startswith(prefix):
            return kind
    return "ALU"


def walk(ins: list, lo: int, hi: int, skip: list, issue: int, level: int, mem: str,
         fence_waits: bool, reads_back: bool = False) -> tuple[int, collections.Counter]:
    """Cycles of one iteration's common path in the in-order one-warp model, and how many of
    them each kind of instruction adds (issue slots under "issue", waits under the kind of
    the instruction waited on). ``fence_waits``: a MEMBAR waits for the global loads in
    flight (those issued in this iteration for the next mini-batch), else it does not.
    ``reads_back``: global loads after the iteration's first wgmma take L2's latency."""
    t = 0
    ready: dict[int, tuple[int, str]] = {}
    gmma_done = 0
    loads_done = 0
    spent: collections.Counter = collections.Counter()
    for a, text, op in ins:
        if not lo <= a <= hi or any(s <= a < e for s, e in skip):
            continue
        if reads_back and op.startswith("HGMMA"):
            mem = "l2"
        dst, src = _regs(text)
        waits = [ready[r] for r in src if r in ready and ready[r][0] > t]
        if waits:
            until, kind = max(waits)
            spent[kind] += until - t
            t = until
        t += issue
        spent["issue"] += issue
        if op.startswith("BAR.SYNC"):
            t += LAT["bar"][level]
            spent["BAR"] += LAT["bar"][level]
        elif op.startswith("MEMBAR"):
            if fence_waits and loads_done > t:
                spent["LDG"] += loads_done - t
                t = loads_done
            t += LAT["membar"][level]
            spent["MEMBAR"] += LAT["membar"][level]
        elif op.startswith("LDG"):
            loads_done = max(loads_done, t + latency(op, level, mem))
        elif op.startswith("HGMMA"):
            n = int(re.search(r"HGMMA\.64x(\d+)x", op).group(1))
            key = "wgmma_n16" if n <= 16 else "wgmma_n32" if n <= 32 else "wgmma_n128"
            gmma_done = max(gmma_done, t + LAT[key][level])
        elif op.startswith("WARPGROUP.DEPBAR") and gmma_done > t:
            spent["wgmma"] += gmma_done - t
            t = gmma_done
        for r in dst:
            ready[r] = (t + latency(op, level, mem), _kind(op))
    return t, spent


def report(D: int, flags: str, stages: int, kernel: str) -> None:
    ins = parse(compile_sass(D, flags, stages, kernel))
    lo, hi = main_loop(ins)
    skip = skipped_regions(ins, lo, hi)
    body = [(a, t, o) for a, t, o in ins if lo <= a <= hi]
    common = [x for x in body if not any(s <= x[0] < e for s, e in skip)]
    kinds = collections.Counter()
    for _, _, op in common:
        kind = ("HGMMA" if op.startswith("HGMMA") else "BAR.SYNC" if op.startswith("BAR")
                else op.split(".")[0])
        kinds[kind] += 1
    warps = 8 if D > 64 else 4
    issue = warps // 4
    print(f"{kernel}: D {D}, flags {flags}, stages {stages}, {warps} warps: loop {len(body)} "
          f"instructions, {len(common)} on the common path (checkpoint store skipped: "
          f"{len(body) - len(common)})")
    top = ", ".join(f"{k} {n}" for k, n in kinds.most_common(24))
    print(f"  by kind: {top}")
    for mem, fence_waits in (("hbm", False), ("hbm", True), ("l2", True)):
        (lo_c, lo_s), (hi_c, hi_s) = (walk(ins, lo, hi, skip, issue, lvl, mem, fence_waits,
                                           kernel in READS_BACK) for lvl in (0, 1))
        how = "a fence waits for them" if fence_waits else "fences do not wait for them"
        if kernel in READS_BACK:
            how += ", rows read back from L2"
        print(f"  inputs from {mem.upper()}, {how}: {lo_c}-{hi_c} cycles, "
              f"{lo_c / CLOCK_GHZ / 1e3:.2f}-{hi_c / CLOCK_GHZ / 1e3:.2f} us per mini-batch; "
              "cycles by cause: " + ", ".join(f"{k} {lo_s[k]}-{hi_s[k]}"
                                             for k, _ in hi_s.most_common()))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--D", type=int, nargs="+", default=[128, 64])
    p.add_argument("--flags", default="all", choices=("all", "none"))
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--kernel", default=KERNELS[0], choices=KERNELS)
    a = p.parse_args()
    for D in a.D:
        report(D, a.flags, a.stages, a.kernel)
