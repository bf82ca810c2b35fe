"""One benchmark run: every target timed, measured and counted over the lengths, written to
results.csv, results.md, meta.json and the plots (``fastweights bench`` builds the options)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import measure
from .report import OUTPUT_FILES, write_csv, write_markdown, write_plots
from .runner import run_targets
from .targets import Setting, mixer_targets, op_targets

__all__ = ["BenchOptions", "method_notes", "run"]


@dataclass
class BenchOptions:
    """Validated options of one benchmark run. ``mixers``: (label, registered name, options)
    per benchmarked mixer, the label as the user wrote it (``ttt-mlp:checkpoint_group=4``);
    ``command``: the command line that repeats the run, recorded in meta.json; ``quick``:
    CI-sized matmul reference."""

    mixers: list[tuple[str, str, dict[str, Any]]]
    lengths: list[int]
    passes: list[str]
    setting: Setting
    repeats: int
    time_budget: float
    ops: bool
    compile: bool
    out: Path
    quick: bool
    progress: bool
    command: str


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical cores, {platform.system()} {platform.release()}"


def _available_memory(device: torch.device) -> float:
    """Bytes free for one measurement (device memory on CUDA, MemAvailable on CPU)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return float("inf")


def method_notes(opts: BenchOptions, memory_ok: bool) -> str:
    """The method paragraph written into results.md."""
    mem = ("CUDA allocator peak (torch.cuda.max_memory_allocated) minus the memory allocated "
           "before the call" if opts.setting.device.type == "cuda" else
           "resident-set high-water mark: VmHWM after the call minus VmRSS before it, the mark "
           "reset through /proc/self/clear_refs, on a separate untimed call during which "
           "glibc's mmap threshold is 64 KiB (mallopt, after malloc_trim) so that every tensor "
           "is fresh memory; timed calls run with normal heap reuse (threshold 32 MiB)")
    if not memory_ok:
        mem = "not measurable on this platform (reported as missing)"
    return "\n".join([
        "- fwd: forward under torch.no_grad (layers in eval mode); fwdbwd: forward in train mode "
        "then backward of y.sum() to the input and every parameter; decode: the state after T "
        "tokens is prefilled (untimed) by the default chunked/parallel form, then "
        f"{8} single-token steps are timed and reported per token (softmax: against its KV "
        "cache; ops: the op with T = 1 and initial_state; the softmax_attention op: one query "
        "against T keys).",
        "- time: one warm-up call, then the median of up to `--repeats` timed calls (fewer when "
        "the time budget would be exceeded; the CSV's `repeats` says how many), "
        "time.perf_counter with device synchronisation.",
        f"- peak memory: {mem}. It includes the outputs and, "
        "for fwdbwd, the activations saved for backward and the gradients.",
        "- FLOPs: torch.utils.flop_counter.FlopCounterMode on one more call; counts only "
        "matrix-multiply-type ops (mm, bmm, addmm, baddbmm, convolution, scaled-dot-product "
        "attention, plus our formulas for the CPU flash-attention kernel and for "
        "linalg_solve_triangular, n^2 k), 2 FLOPs per multiply-add, dense blocks counted in "
        "full even where masked; elementwise work (exp, cumsum, norms) is not counted. GFLOP/s ="
        " counted FLOPs / median time, next to the machine's measured square-matmul rate.",
        "- skipping: lengths run smallest first; a config is skipped (and listed) when a power "
        "law fitted to the two previous lengths predicts that two calls exceed the time budget "
        "or that its peak memory exceeds half the memory available at the start.",
        "- the softmax mixer (and the softmax_attention op) is the baseline: `x` in the tokens/s "
        "table is softmax time / this time at the same T and pass.",
        "- all numbers come from one process, measured one after another.",
    ])


def run(opts: BenchOptions) -> None:
    """Measure every target of ``opts`` and write the results into ``opts.out`` (created; the
    earlier results there, ``OUTPUT_FILES``, replaced)."""
    s = opts.setting
    memory_ok = s.device.type == "cuda" or measure.prepare_cpu_memory_accounting()
    targets = mixer_targets(opts.mixers)
    left_out: dict[str, str] = {}
    if opts.ops:
        op_list, left_out = op_targets(s)
        targets += op_list
    sizes = (64, 128, 256) if opts.quick else (256, 512, 1024, 2048)
    # CPU BLAS has no fast half-precision matmul: rate the machine in float32 then.
    fast_dtype = s.device.type == "cuda" or s.dtype in (torch.float32, torch.float64)
    matmul_dtype = s.dtype if fast_dtype else torch.float32
    peak, peak_n = measure.matmul_gflops(s.device, matmul_dtype, sizes,
                                         min_seconds=0.05 if opts.quick else 0.3)
    print(f"matrix-multiply rate: {peak:.1f} GFLOP/s ({matmul_dtype}, n={peak_n}); "
          f"{len(targets)} targets x {len(opts.lengths)} lengths", file=sys.stderr)
    rows = run_targets(targets, opts.lengths, opts.passes, s, opts.repeats, opts.time_budget,
                       memory_limit=0.5 * _available_memory(s.device), memory=memory_ok,
                       compile_check=opts.compile, progress=opts.progress)
    meta = {
        "command": opts.command,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": _machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "device": str(s.device), "dtype": str(s.dtype).removeprefix("torch."),
        "batch": s.batch, "d_model": s.d_model, "n_heads": s.n_heads,
        "repeats": opts.repeats, "time_budget": opts.time_budget,
        "matmul_gflops_per_s": peak, "matmul_n": peak_n, "matmul_dtype": str(matmul_dtype),
        "left_out_ops": left_out,
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:  # --overwrite: drop stale files (e.g. plots without matplotlib)
        (opts.out / name).unlink(missing_ok=True)
    write_csv(opts.out / "results.csv", rows, meta)
    write_markdown(opts.out / "results.md", rows, meta, method_notes(opts, memory_ok))
    (opts.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    written = write_plots(opts.out, rows)
    n_ok = sum(r.status == "ok" for r in rows)
    print(f"{n_ok}/{len(rows)} configs measured; wrote {opts.out}/results.csv, results.md, "
          f"meta.json" + "".join(f", {p.name}" for p in written), file=sys.stderr)
