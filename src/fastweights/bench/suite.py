"""One benchmark run: every target timed, measured and counted over the lengths, written to
results.csv, results.md, meta.json and the plots (``fastweights bench`` builds the options)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import measure
from .peers import peer_table, run_peers
from .record import Record, cpu_info
from .report import EXTRA_FILES, csv_rows, markdown, peer_rows_table, plots, width_table
from .runner import run_targets
from .targets import Setting, mixer_targets, op_targets, scan_width

__all__ = ["BenchOptions", "cpu_info", "method_notes", "run"]


@dataclass
class BenchOptions:
    """Validated options of one benchmark run. ``mixers``: (label, registered name, options)
    per benchmarked mixer, the label as the user wrote it (``ttt-mlp:checkpoint_group=4``);
    ``command``: the command line that repeats the run, recorded in meta.json; ``quick``:
    CI-sized matmul reference; ``threads``: the torch thread counts every figure is measured
    at, interleaved round by round (the first is the speed-ups' reference)."""

    mixers: list[tuple[str, str, dict[str, Any]]]
    lengths: list[int]
    passes: list[str]
    setting: Setting
    repeats: int
    time_budget: float
    ops: bool
    peers: bool
    compile: bool
    out: Path
    quick: bool
    progress: bool
    command: str
    threads: list[int] = field(default_factory=lambda: [torch.get_num_threads()])
    op_forms: list[str] | None = None  # with ``ops``: only these op targets (None: all)
    overwrite: bool = False  # replace an earlier record in ``out`` (its files only)


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


def _matmul_rates(opts: BenchOptions, dtype: torch.dtype, sizes: tuple[int, ...]
                  ) -> dict[int, tuple[float, int]]:
    """{thread count: (square-matmul GFLOP/s, best size)} at every count of ``opts.threads``."""
    before = torch.get_num_threads()
    rates = {}
    try:
        for n in opts.threads:
            torch.set_num_threads(n)
            rates[n] = measure.matmul_gflops(opts.setting.device, dtype, sizes,
                                             min_seconds=0.05 if opts.quick else 0.3)
    finally:
        torch.set_num_threads(before)
    return rates


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
        "time.perf_counter with device synchronisation. With several `--threads` counts the "
        "calls run in rounds: round r sets each count in the order given "
        "(torch.set_num_threads) and times one call at each; the warm-up is one call per "
        "count; each count's median and min-max are over the rounds, and its speed-up is "
        "the median (and min-max) of the per-round ratios time(first count) / time(count). "
        "The op rate compares with the matmul rate measured at the same thread count; the peer "
        "table times ours and the peer at each count within the same rounds.",
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
    """Measure every target of ``opts`` and write the record into ``opts.out`` (claimed first:
    refused if it holds anything unless ``opts.overwrite``, bench/record.py)."""
    rec = Record(opts.out, "bench", overwrite=opts.overwrite, files=EXTRA_FILES)
    s = opts.setting
    memory_ok = s.device.type == "cuda" or measure.prepare_cpu_memory_accounting()
    targets = mixer_targets(opts.mixers)
    left_out: dict[str, str] = {}
    if opts.ops:
        op_list, left_out = op_targets(s)
        targets += [t for t in op_list if opts.op_forms is None or t.name in opts.op_forms]
    sizes = (64, 128, 256) if opts.quick else (256, 512, 1024, 2048)
    # CPU BLAS has no fast half-precision matmul: rate the machine in float32 then.
    fast_dtype = s.device.type == "cuda" or s.dtype in (torch.float32, torch.float64)
    matmul_dtype = s.dtype if fast_dtype else torch.float32
    rates = _matmul_rates(opts, matmul_dtype, sizes)
    peak, peak_n = rates[opts.threads[0]]
    print("matrix-multiply rate: " + ", ".join(f"{r:.1f} GFLOP/s at {n} threads (n={size})"
                                                 for n, (r, size) in rates.items())
          + f" ({matmul_dtype}); {len(targets)} targets x {len(opts.lengths)} lengths",
          file=sys.stderr)
    rows = run_targets(targets, opts.lengths, opts.passes, s, opts.repeats, opts.time_budget,
                       memory_limit=0.5 * _available_memory(s.device), memory=memory_ok,
                       compile_check=opts.compile, progress=opts.progress,
                       threads=opts.threads)
    peer_rows, peers_missing = [], {}
    if opts.peers:
        peer_rows, peers_missing = run_peers(opts.lengths, s.batch, s.n_heads,
                                             s.d_model // s.n_heads, opts.repeats,
                                             opts.time_budget, threads=opts.threads)
    by_label = {label: (name, options) for label, name, options in opts.mixers}
    widths = {t.name: {str(T): dataclasses.asdict(w) for T in opts.lengths
                       if (w := scan_width(t, T, s, by_label)) is not None} for t in targets}
    meta = rec.meta(
        opts.command, threads=opts.threads, device=str(s.device),
        dtype=str(s.dtype).removeprefix("torch."), batch=s.batch, d_model=s.d_model,
        n_heads=s.n_heads, repeats=opts.repeats, time_budget=opts.time_budget,
        matmul_gflops_per_s=peak, matmul_n=peak_n, matmul_dtype=str(matmul_dtype),
        matmul_by_threads={str(n): {"gflops_per_s": r, "n": size}
                           for n, (r, size) in rates.items()},
        scan_width={name: w for name, w in widths.items() if w},
        left_out_ops=left_out, peers_missing=peers_missing)
    files: dict[str, Any] = plots(rows)
    if opts.peers:
        files["peers.csv"] = peer_rows_table(peer_rows)
    rec.write(csv_rows(rows, meta), meta,
              markdown=markdown(rows, meta, method_notes(opts, memory_ok),
                                (peer_table(peer_rows, peers_missing) if opts.peers else [])
                                + width_table(meta["scan_width"], s)),
              files=files)
    n_ok = sum(r.status == "ok" for r in rows)
    print(f"{n_ok}/{len(rows)} configs measured; wrote {opts.out}/results.csv, results.md, "
          f"meta.json, lscpu.txt" + "".join(f", {p}" for p in files), file=sys.stderr)
