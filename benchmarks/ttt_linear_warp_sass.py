"""A latency estimate of one mini-batch of TTT-Linear's warp forward (ops/ttt/cuda/
ttt_linear_warp.cu, one warp per (batch, head), head size 64) from its SASS, without a GPU
(docs/gpu_ttt_kernels.md, "One warp per head").

Compiles the kernel with nvcc for sm_90 as the library is built (ops/ttt/cluster.py
``NVCC_FLAGS``' optimisation), with every flag on at compile time (``FW_LINEAR_ALL_FLAGS``: the
layers' case; the shipped kernel reads the flags at run time, a few uniform branches more),
disassembles the cubin with the cuobjdump shipped in the triton wheel, finds the loop over
mini-batches (the widest backward branch), leaves out what a full mini-batch does not run (the
checkpoint store, taken once every ``seg`` mini-batches, and the sums of a partial last
mini-batch), counts the instructions by kind and walks them through an in-order model of the
one warp, alone on its scheduler (benchmarks/ttt_resident_sass.py's model, with the
tensor-core and shared-memory pipes of mma.sync):

- every instruction takes an issue cycle; an instruction waits for the registers it reads:
  ALU 4-5 cycles, MUFU 18-24, SHFL 23-30, LDS/LDSM 29-35 (and so the generic loads LD.E and
  the transposes MOVM of nvcc's bfloat16 WMMA loads, which do not use LDSM), HMMA 30-36
  (low and high sets);
- an HMMA.16816 occupies the warp's tensor core ``HMMA_INTERVAL`` cycles (4: the sub-core's
  share of the SM's dense rate; 8: mma.sync at about half of it);
- a shared-memory access occupies the SM's shared-memory pipe bytes / 128 cycles;
- the next mini-batch's global loads are issued at the top of this one and read at the top of
  the next, so they wait only if a mini-batch took less than their latency (HBM 500-800
  cycles): the estimate says whether it does.

Run from the repository root:

    PYTHONPATH=src python benchmarks/ttt_linear_warp_sass.py [--dtype bfloat16] [--source F]

Prints the instruction counts of the loop's common path and the estimated cycles and
microseconds per mini-batch (at 1.755 GHz, the H100 SXM boost clock; an H200 boosts to
1.98 GHz).
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(Path(__file__).resolve().parent)]

from ttt_resident_sass import (  # noqa: E402
    CLOCK_GHZ,
    LAT,
    REG,
    forward_branches,
    main_loop,
    parse,
)

LAT_HMMA = (30, 36)
HMMA_INTERVAL = (4, 8)
SMEM_BYTES_PER_CYCLE = 128
MANGLED = {"bfloat16": "13__nv_bfloat16", "float16": "6__half"}


def compile_sass(dtype: str, source: Path | None = None) -> str:
    """The SASS of the kernel's ``dtype`` instantiation, every flag on at compile time, from
    ``source`` (default: ops/ttt/cuda/ttt_linear_warp.cu)."""
    from fastweights.ops.ttt import cluster, linear_cuda

    tool = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90", "-cubin",
                        "-DFW_LINEAR_ALL_FLAGS", "-I", str(cluster.SOURCE_DIR),
                        str(source or linear_cuda.SOURCE), "-o", str(cubin)], check=True)
        name = f"_ZN13fw_ttt_linear19ttt_linear_warp_fwdI{MANGLED[dtype]}EEv19FwTTTLinearWarpArgs"
        return subprocess.run([str(tool), "-sass", "-fun", name, str(cubin)],
                              capture_output=True, text=True, check=True).stdout


def skipped_regions(ins: list, lo: int, hi: int) -> list[tuple[int, int]]:
    """Forward branches inside the loop over what a full mini-batch does not run: a region
    with global stores before the loop's first HMMA (the checkpoint store) or with global
    stores and HMMAs (a partial last mini-batch's sums)."""
    first_mma = min(a for a, _, o in ins if lo <= a <= hi and o.startswith("HMMA"))
    return [(s, e) for s, e, body in forward_branches(ins, lo, hi)
            if any(o.startswith("STG") for o in body)
            and (any(o.startswith("HMMA") for o in body) or e <= first_mma)]


def regs(text: str) -> tuple[list[int], list[int]]:
    """(destination registers, source registers) of an instruction, vector forms widened
    (HMMA.16816's D and C 4 registers, A 4, B 2; LDSM's .x2/.x4)."""
    parts = text.split(None, 1)
    if len(parts) < 2:
        return [], []
    op, ops = parts[0], [p.strip() for p in parts[1].split(",")]

    def rr(s: str, w: int) -> list[int]:
        return [int(r) + i for r in REG.findall(s) for i in range(w)]

    if op.startswith("HMMA"):
        return rr(ops[0], 4), rr(ops[1], 4) + rr(ops[2], 2) + rr(ops[3], 4)
    width = 4 if ".128" in op or op.endswith(".4") else 2 if ".64" in op or op.endswith(".2") else 1
    if op.startswith(("STG", "STS", "ST.", "BAR", "MEMBAR", "BRA", "WARPSYNC")):
        return [], rr(",".join(ops), width)
    if not REG.search(ops[0]) and len(ops) > 1:  # a predicate first
        ops = ops[1:]
    return rr(ops[0], width), rr(",".join(ops[1:]), 1)


def kind(op: str) -> str:
    for prefix, k in (("HMMA", "HMMA"), ("LDSM", "LDS"), ("LDS", "LDS"), ("STS", "STS"),
                      ("LD.", "LDS"), ("MOVM", "LDS"),
                      ("LDG", "LDG"), ("STG", "STG"), ("SHFL", "SHFL"), ("MUFU", "MUFU"),
                      ("BAR", "BAR"), ("WARPSYNC", "WARPSYNC"), ("NOP", "WARPSYNC"),
                      ("BRA", "BRA"), ("CALL", "BRA"), ("BSSY", "BRA"), ("BSYNC", "BRA")):
        if op.startswith(prefix):
            return k
    return "ALU"


def smem_bytes(op: str) -> int:
    """Bytes one warp's shared-memory access moves (LDSM: 8x8 16-bit matrices)."""
    if op.startswith(("LD.", "MOVM")):  # WMMA's generic loads (bfloat16), its transposes
        return 128
    if op.startswith("LDSM"):
        return 128 * (4 if op.endswith(".4") else 2 if op.endswith(".2") else 1)
    return 32 * (16 if ".128" in op else 8 if ".64" in op else 2 if ".U16" in op or ".16" in op
                 else 4)


def walk(common: list, level: int) -> tuple[int, collections.Counter]:
    """Cycles of one full mini-batch's path in the in-order model, and how many of them each
    cause adds (issue slots; waits under the kind of the instruction waited on; the tensor
    and shared-memory pipes)."""
    t = 0
    ready: dict[int, tuple[int, str]] = {}
    tensor_free = smem_free = 0
    spent: collections.Counter = collections.Counter()
    marks: list[int] = []  # the cycle after each CTA barrier
    for _, text, op in common:
        dst, src = regs(text)
        waits = [ready[r] for r in src if r in ready and ready[r][0] > t]
        if waits:
            until, k = max(waits)
            spent[k] += until - t
            t = until
        k = kind(op)
        if k == "HMMA" and tensor_free > t:
            spent["tensor pipe"] += tensor_free - t
            t = tensor_free
        if k in ("LDS", "STS") and smem_free > t:
            spent["shared-memory pipe"] += smem_free - t
            t = smem_free
        t += 1
        spent["issue"] += 1
        if k == "BAR":
            t += LAT["bar"][level]
            spent["BAR"] += LAT["bar"][level]
            marks.append(t)
        if k == "HMMA":
            tensor_free = t + HMMA_INTERVAL[level] - 1
        if k in ("LDS", "STS"):
            smem_free = t + smem_bytes(op) // SMEM_BYTES_PER_CYCLE - 1
        lat = {"HMMA": LAT_HMMA[level], "LDS": LAT["lds"][level], "SHFL": LAT["shfl"][level],
               "MUFU": LAT["mufu"][level], "LDG": 10 ** 9}.get(k, LAT["alu"][level])
        for r in dst:  # a global load's value is read in the next mini-batch (never here)
            ready[r] = (t + lat, k) if k != "LDG" else (0, k)
    spent["phases"] = marks
    return t, spent


def report(dtype: str, source: Path | None = None) -> None:
    ins = parse(compile_sass(dtype, source))
    lo, hi = main_loop(ins)
    skip = skipped_regions(ins, lo, hi)
    body = [x for x in ins if lo <= x[0] <= hi]
    common = [x for x in body if not any(s <= x[0] < e for s, e in skip)]
    kinds = collections.Counter(kind(o) for _, _, o in common)
    hmma = collections.Counter(o for _, _, o in common if o.startswith("HMMA"))
    print(f"ttt_linear_warp_fwd<{dtype}>, every flag on: loop {len(body)} instructions, "
          f"{len(common)} on a full mini-batch's path (left out: {len(body) - len(common)}, "
          f"the checkpoint store and a partial mini-batch's sums)")
    print("  by kind: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
    print("  HMMA: " + ", ".join(f"{k} {n}" for k, n in hmma.items()))
    for level, name in ((0, "low"), (1, "high")):
        cyc, spent = walk(common, level)
        marks = spent.pop("phases")
        print(f"  {name} latencies: {cyc} cycles, {cyc / CLOCK_GHZ / 1e3:.2f} us per mini-batch "
              f"at {CLOCK_GHZ} GHz ({cyc / 1.98 / 1e3:.2f} at 1.98); cycles by cause: "
              + ", ".join(f"{k} {n}" for k, n in spent.most_common()))
        if marks:
            print("    cycles at each CTA barrier's end: " + ", ".join(map(str, marks)))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"], choices=list(MANGLED))
    p.add_argument("--source", type=Path, default=None,
                   help="another version of ttt_linear_warp.cu (e.g. from git history)")
    args = p.parse_args()
    for dt in args.dtype:
        report(dt, args.source)
