"""``fastweights bench``: options, validation (one-line errors) and the run that writes results.

Every option is parsed here rather than by argparse so that any bad value, whatever the option,
is reported the same way: one line on stderr and exit code 2 (``UserError`` in ``cli``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cli import UserError, make_folder
from ..models.registry import check_mixer, mixer_names
from ..train.specs import SpecError, parse_mixer_spec
from . import measure
from .peers import peer_table, run_peers
from .report import OUTPUT_FILES, write_csv, write_markdown, write_peer_csv, write_plots
from .runner import PASSES, run_targets
from .targets import Setting, mixer_targets, op_targets

__all__ = ["BenchOptions", "add_arguments", "cpu_info", "parse_options", "run"]

DEFAULT_LENGTHS = "512..16384"
FULL_LENGTHS = "512..65536"
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16}
_DEFAULTS = {"lengths": None, "d_model": "512", "n_heads": "8", "repeats": "5",
             "time_budget": "4"}
# --quick: a CI-sized end-to-end check (all code paths, tiny shapes, well under a minute).
_QUICK = {"lengths": "16,32", "d_model": "32", "n_heads": "2", "repeats": "2",
          "time_budget": "2"}


@dataclass
class BenchOptions:
    """Validated options of one benchmark run."""

    mixers: list[str]
    lengths: list[int]
    passes: list[str]
    setting: Setting
    repeats: int
    time_budget: float
    ops: bool
    peers: bool
    compile: bool
    out: Path
    overwrite: bool
    quick: bool
    progress: bool


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` options (all parsed as strings, validated by ``parse_options``)."""
    p.add_argument("--mixers", default="all",
                   help="comma-separated registered mixer names with options as name:opt=value "
                        "(e.g. ttt-mlp:checkpoint_group=4), or 'all' (default); the softmax "
                        "baseline is always added; 'none' benchmarks only --ops")
    p.add_argument("--lengths", default=None,
                   help=f"comma-separated T values, or A..B for the powers of two from A to B "
                        f"(default {DEFAULT_LENGTHS}; --full uses {FULL_LENGTHS})")
    p.add_argument("--full", action="store_true", help=f"lengths {FULL_LENGTHS}")
    p.add_argument("--d-model", default=_DEFAULTS["d_model"])
    p.add_argument("--n-heads", default=_DEFAULTS["n_heads"])
    p.add_argument("--batch", default="1")
    p.add_argument("--dtype", default="float32", help="|".join(_DTYPES))
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--repeats", default=_DEFAULTS["repeats"],
                   help="timed calls per config (median reported)")
    p.add_argument("--passes", default=",".join(PASSES),
                   help="comma-separated subset of " + ",".join(PASSES))
    p.add_argument("--time-budget", default=_DEFAULTS["time_budget"],
                   help="seconds per (target, T, pass); configs predicted to take longer are "
                        "skipped and recorded as such")
    p.add_argument("--quick", action="store_true",
                   help="CI-sized preset: lengths 16,32, d_model 32, 2 heads, 2 repeats")
    p.add_argument("--ops", action="store_true",
                   help="also benchmark the op-level forms (every mode of every op)")
    p.add_argument("--peers", action="store_true",
                   help="also time the installed peers' CPU references (flash-linear-attention's "
                        "pure-PyTorch chunked forms, torch SDPA) next to our ops, forward, "
                        "float32, same process; written to peers.csv and results.md")
    p.add_argument("--compile", action="store_true",
                   help="also torch.compile each mixer: max |compiled - eager| and its time")
    p.add_argument("--out", default="bench_results", help="output folder (default bench_results/)")
    p.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{name} must be a positive integer, got {text!r}") from None
    if value < 1:
        raise UserError(f"{name} must be a positive integer, got {value}")
    return value


def _lengths(text: str) -> list[int]:
    if ".." in text:
        lo_text, hi_text = text.split("..", 1)
        lo, hi = _positive_int("--lengths start", lo_text), _positive_int("--lengths end", hi_text)
        if hi < lo:
            raise UserError(f"--lengths range {text!r} must go from small to large")
        out = [lo]
        while out[-1] * 2 <= hi:
            out.append(out[-1] * 2)
        return out
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise UserError("--lengths must name at least one length")
    return sorted({_positive_int("--lengths entry", s) for s in items})


def parse_options(args: argparse.Namespace) -> BenchOptions:
    """Validate the raw option strings; raises UserError naming the option."""
    raw = vars(args).copy()
    if args.quick:
        for key, value in _QUICK.items():
            if raw[key] == _DEFAULTS[key]:  # options given explicitly win over the preset
                raw[key] = value
    registered = mixer_names()
    if raw["mixers"] == "all":
        mixers = registered
    elif raw["mixers"] == "none":
        mixers = []
    else:
        mixers = [m.strip() for m in raw["mixers"].split(",") if m.strip()]
        try:
            specs = [parse_mixer_spec(m) for m in mixers]
        except SpecError as err:
            raise UserError(f"--mixers: {err}") from None
        unknown = [n for n, _ in specs if n not in registered]
        if unknown or not mixers:
            raise UserError(f"unknown mixer(s) {unknown or raw['mixers']!r} in --mixers; "
                            f"registered: {', '.join(registered)} (or 'all', 'none')")

    if mixers and "softmax" in registered and not any(m.split(":")[0] == "softmax" for m in mixers):
        mixers = ["softmax", *mixers]  # the baseline every report compares against
    if not mixers and not args.ops and not args.peers:
        raise UserError("--mixers none needs --ops or --peers (nothing to benchmark otherwise)")
    lengths = _lengths(raw["lengths"] or (FULL_LENGTHS if args.full else DEFAULT_LENGTHS))
    passes = [p.strip() for p in raw["passes"].split(",") if p.strip()]
    bad = [p for p in passes if p not in PASSES]
    if bad or not passes:
        raise UserError(f"unknown pass(es) {bad or raw['passes']!r} in --passes; "
                        f"choose from {','.join(PASSES)}")
    d_model = _positive_int("--d-model", raw["d_model"])
    n_heads = _positive_int("--n-heads", raw["n_heads"])
    if d_model % n_heads:
        raise UserError(f"--d-model ({d_model}) must be divisible by --n-heads ({n_heads})")
    batch = _positive_int("--batch", raw["batch"])
    if raw["dtype"] not in _DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(_DTYPES)}, got {raw['dtype']!r}")
    try:
        device = torch.device(raw["device"])
    except RuntimeError:
        raise UserError(f"--device {raw['device']!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device must be cpu or cuda[:N], got {raw['device']!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {raw['device']!r} asked for, but CUDA is not available")
    repeats = _positive_int("--repeats", raw["repeats"])
    try:
        budget = float(raw["time_budget"])
    except ValueError:
        budget = float("nan")
    if not budget > 0 or budget == float("inf"):
        raise UserError(f"--time-budget must be a positive number of seconds, got "
                        f"{raw['time_budget']!r}")
    out = Path(raw["out"])
    if not args.overwrite:
        existing = [f for f in OUTPUT_FILES if (out / f).exists()]
        if existing:
            raise UserError(f"--out {str(out)!r} already holds results ({', '.join(existing)}); "
                            "pass --overwrite to replace them or choose another folder")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} exists and is not a folder")
    for spec in mixers:  # option names and values, up front
        name, opts = parse_mixer_spec(spec)
        try:
            check_mixer(name, d_model, n_heads, **opts)
        except (ValueError, TypeError) as err:
            raise UserError(f"--mixers {spec}: {err}") from None
    make_folder(out)  # before measuring: a bad --out must not cost the measurements
    setting = Setting(batch, d_model, n_heads, _DTYPES[raw["dtype"]], device)
    if args.peers and device.type != "cpu":
        raise UserError("--peers compares CPU references: it needs --device cpu")
    return BenchOptions(mixers, lengths, passes, setting, repeats, budget, args.ops, args.peers,
                        args.compile, out, args.overwrite, args.quick, not args.no_progress)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical cores, {platform.system()} {platform.release()}"


# Instruction-set flags (as /proc/cpuinfo spells them) that decide CPU matmul speed: vector
# width (AVX2/FMA, AVX-512 families), bfloat16/int8 dot products (AVX512_BF16, VNNI) and AMX.
_ISA_PREFIXES = ("avx", "fma", "amx", "f16c")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """{"model": CPU model name or None, "isa": sorted vector/matrix instruction-set flags}, read
    from /proc/cpuinfo (or the given text); empty where the file is unavailable (not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return {"model": None, "isa": []}
    model, flags = None, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return {"model": model, "isa": sorted(f for f in flags if f.startswith(_ISA_PREFIXES))}


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


def _command_line(opts: BenchOptions) -> str:
    """The run's options spelled out in full, to repeat it exactly."""
    s = opts.setting
    parts = ["fastweights", "bench", "--mixers", ",".join(opts.mixers) or "none",
             "--lengths", ",".join(map(str, opts.lengths)), "--d-model", str(s.d_model),
             "--n-heads", str(s.n_heads), "--batch", str(s.batch),
             "--dtype", str(s.dtype).removeprefix("torch."), "--device", str(s.device),
             "--repeats", str(opts.repeats), "--passes", ",".join(opts.passes),
             "--time-budget", f"{opts.time_budget:g}"]
    parts += [flag for flag, on in (("--ops", opts.ops), ("--peers", opts.peers),
                                    ("--compile", opts.compile)) if on]
    return " ".join(shlex.quote(p) for p in parts)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fastweights bench``."""
    opts = parse_options(args)
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
    peer_rows, peers_missing = [], {}
    if opts.peers:
        peer_rows, peers_missing = run_peers(opts.lengths, s.batch, s.n_heads,
                                             s.d_model // s.n_heads, opts.repeats,
                                             opts.time_budget)
    cpu = cpu_info()
    meta = {
        "command": _command_line(opts),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": _machine(), "cpu_model": cpu["model"], "cpu_isa": cpu["isa"],
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "device": str(s.device), "dtype": str(s.dtype).removeprefix("torch."),
        "batch": s.batch, "d_model": s.d_model, "n_heads": s.n_heads,
        "repeats": opts.repeats, "time_budget": opts.time_budget,
        "matmul_gflops_per_s": peak, "matmul_n": peak_n, "matmul_dtype": str(matmul_dtype),
        "left_out_ops": left_out,
        "peers_missing": peers_missing,
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:  # --overwrite: drop stale files (e.g. plots without matplotlib)
        (opts.out / name).unlink(missing_ok=True)
    write_csv(opts.out / "results.csv", rows, meta)
    if opts.peers:
        write_peer_csv(opts.out / "peers.csv", peer_rows)
    write_markdown(opts.out / "results.md", rows, meta, method_notes(opts, memory_ok),
                   peer_table(peer_rows, peers_missing) if opts.peers else None)
    (opts.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    written = write_plots(opts.out, rows)
    n_ok = sum(r.status == "ok" for r in rows)
    print(f"{n_ok}/{len(rows)} configs measured; wrote {opts.out}/results.csv, results.md, "
          f"meta.json" + "".join(f", {p.name}" for p in written), file=sys.stderr)
    return 0
