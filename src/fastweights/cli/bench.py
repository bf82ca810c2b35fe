"""``fastweights bench``: without a name the suite, time, memory and FLOP rate of every mixer
(and op) against T (``fastweights.bench.suite``); ``fastweights bench NAME`` one of the focused
benchmarks of ``fastweights.bench.BENCHMARKS``, whose module is loaded when it is named (its
parser is filled from the module then), so that ``fastweights bench --help`` imports no torch.
The suite's own modules are imported when it runs."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from .. import bench
from .._commands import (
    HelpFormatter,
    LazyParser,
    UserError,
    check_out,
    make_folder,
    parse_int_list,
    parse_mixer_spec,
    positive_float,
    positive_int,
)
from ..bench import PASSES

if TYPE_CHECKING:
    import torch

    from ..bench import suite
    from ..bench.targets import Setting

NAME = "bench"
DESCRIPTION = ("Benchmark every registered mixer (and with --ops every form of every op) over "
               "sequence lengths T: forward, forward+backward and per-token decoding time, peak "
               "memory and GFLOP/s, against the softmax baseline. Writes its record into --out: "
               "results.csv, results.md, meta.json, lscpu.txt and plots. With a NAME, one of "
               "the focused benchmarks instead (fastweights bench NAME --help).")

DEFAULT_LENGTHS = "512..16384"
FULL_LENGTHS = "512..65536"
_DTYPES = ("float32", "float64", "bfloat16", "float16")  # torch dtype names
# Options with a preset: their default, and --quick's (a CI-sized end-to-end check: all code
# paths, tiny shapes, well under a minute). An option given explicitly wins over both.
_PRESETS = {"d_model": (512, 32), "n_heads": (8, 2), "repeats": (5, 2), "time_budget": (4.0, 2.0)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    def preset(key: str) -> str:
        return f" (default: {_PRESETS[key][0]:g}; --quick: {_PRESETS[key][1]:g})"

    p.add_argument("--mixers", default="all",
                   help="comma-separated registered mixer names with options as name:opt=value "
                        "(e.g. ttt-mlp:checkpoint_group=4), or 'all'; the softmax baseline is "
                        "always added; 'none' benchmarks only --ops")
    p.add_argument("--lengths", default=None,
                   help=f"comma-separated T values, or A..B for the powers of two from A to B "
                        f"(default: {DEFAULT_LENGTHS}; --full: {FULL_LENGTHS}; --quick: 16,32)")
    p.add_argument("--full", action="store_true", help=f"lengths {FULL_LENGTHS}")
    p.add_argument("--d-model", type=positive_int, default=None, help=preset("d_model"))
    p.add_argument("--n-heads", type=positive_int, default=None, help=preset("n_heads"))
    p.add_argument("--batch", type=positive_int, default=1, help="batch size B")
    p.add_argument("--dtype", default="float32", choices=_DTYPES, help="inputs and weights")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="timed calls per config (median reported)" + preset("repeats"))
    p.add_argument("--passes", default=",".join(PASSES),
                   help="comma-separated subset of " + ",".join(PASSES))
    p.add_argument("--time-budget", type=positive_float, default=None,
                   help="seconds per (target, T, pass); configs predicted to take longer are "
                        "skipped and recorded as such" + preset("time_budget"))
    p.add_argument("--quick", action="store_true",
                   help="CI-sized preset: lengths 16,32, d_model 32, 2 heads, 2 repeats")
    p.add_argument("--ops", action="store_true",
                   help="also benchmark the op-level forms (every mode of every op)")
    p.add_argument("--op-forms", default=None,
                   help="with --ops (implied): only these op forms, comma-separated as the "
                        "report names them, e.g. linear_attn[chunk],ttt_mlp[dual] (an op "
                        "without modes by its name, e.g. softmax_attention)")
    p.add_argument("--peers", action="store_true",
                   help="also time the installed peers' CPU references (flash-linear-attention's "
                        "pure-PyTorch chunked forms, torch SDPA) next to our ops, forward, "
                        "float32, same process; written to peers.csv and results.md")
    p.add_argument("--threads", default=None,
                   help="comma-separated torch thread counts (e.g. 1,2): every figure is "
                        "measured at each, the counts interleaved round by round in this "
                        "process, with the speed-up from the first count to each other "
                        "(default: torch's current count)")
    p.add_argument("--compile", action="store_true",
                   help="also torch.compile each mixer: max |compiled - eager| and its time")
    p.add_argument("--out", default="bench_results", help="output folder")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier record in --out (its files only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_benchmarks(p)


def _length(text: str, what: str) -> int:
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as err:
        raise UserError(f"--lengths {what} {err}") from None


def _lengths(text: str) -> list[int]:
    if ".." in text:
        lo_text, hi_text = text.split("..", 1)
        lo, hi = _length(lo_text, "start"), _length(hi_text, "end")
        if hi < lo:
            raise UserError(f"--lengths range {text!r} must go from small to large")
        out = [lo]
        while out[-1] * 2 <= hi:
            out.append(out[-1] * 2)
        return out
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise UserError("--lengths must name at least one length")
    return sorted({_length(s, "entry") for s in items})


def _mixers(text: str, ops: bool, peers: bool) -> list[tuple[str, str, dict]]:
    """(label, name, options) of every mixer ``--mixers`` names, the softmax baseline first
    unless named."""
    from ..models.registry import mixer_names

    registered = mixer_names()
    if text in ("all", "none"):
        specs = [(name, name, {}) for name in registered] if text == "all" else []
    else:
        specs = [(m.strip(), *parse_mixer_spec("--mixers", m)) for m in text.split(",") if m.strip()]
        unknown = [name for _, name, _ in specs if name not in registered]
        if unknown or not specs:
            raise UserError(f"unknown mixer(s) {unknown or text!r} in --mixers; "
                            f"registered: {', '.join(registered)} (or 'all', 'none')")
    if specs and "softmax" in registered and all(name != "softmax" for _, name, _ in specs):
        specs = [("softmax", "softmax", {}), *specs]  # the baseline every report compares against
    if not specs and not ops and not peers:
        raise UserError("--mixers none needs --ops or --peers (nothing to benchmark otherwise)")
    return specs


def _threads(text: str | None) -> list[int]:
    """``--threads``: distinct positive counts in the order given; torch's current count when
    not given."""
    if text is None:
        import torch

        return [torch.get_num_threads()]
    counts = parse_int_list("--threads", text)
    if len(set(counts)) != len(counts):
        raise UserError(f"--threads lists a count twice: {text!r}")
    return counts


def _op_forms(text: str, setting: Setting) -> list[str]:
    """``--op-forms``: op target names that ``op_targets`` offers at this setting."""
    from ..bench.targets import op_targets

    names = [n.strip() for n in text.split(",") if n.strip()]
    offered = [t.name for t in op_targets(setting)[0]]
    unknown = [n for n in names if n not in offered]
    if unknown or not names:
        raise UserError(f"unknown op form(s) {unknown or text!r} in --op-forms; "
                        f"offered: {', '.join(offered)}")
    return list(dict.fromkeys(names))


def _device(text: str) -> torch.device:
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise UserError(f"--device {text!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device must be cpu or cuda[:N], got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {text!r} asked for, but CUDA is not available")
    return device


def parse_options(args: argparse.Namespace) -> suite.BenchOptions:
    """The validated options of the run (UserError naming the option); creates ``--out``."""
    import torch

    from ..bench import suite
    from ..bench.targets import Setting
    from ..models.registry import check_mixer

    preset = 1 if args.quick else 0
    d_model, n_heads, repeats, budget = (
        _PRESETS[key][preset] if getattr(args, key) is None else getattr(args, key)
        for key in ("d_model", "n_heads", "repeats", "time_budget"))
    ops = args.ops or args.op_forms is not None
    mixers = _mixers(args.mixers, ops, args.peers)
    lengths = _lengths(args.lengths or ("16,32" if args.quick else
                                        FULL_LENGTHS if args.full else DEFAULT_LENGTHS))
    passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    bad = [p for p in passes if p not in PASSES]
    if bad or not passes:
        raise UserError(f"unknown pass(es) {bad or args.passes!r} in --passes; "
                        f"choose from {','.join(PASSES)}")
    if d_model % n_heads:
        raise UserError(f"--d-model ({d_model}) must be divisible by --n-heads ({n_heads})")
    device = _device(args.device)
    threads = _threads(args.threads)
    if args.peers and device.type != "cpu":
        raise UserError("--peers compares CPU references: it needs --device cpu")
    out = Path(args.out)
    check_out(out, args.overwrite)  # the record writer's rule (bench/record.py), before any work
    for label, name, opts in mixers:  # option names and values, up front
        try:
            check_mixer(name, d_model, n_heads, **opts)
        except (ValueError, TypeError) as err:
            raise UserError(f"--mixers {label}: {err}") from None
    setting = Setting(args.batch, d_model, n_heads, getattr(torch, args.dtype), device)
    op_forms = None if args.op_forms is None else _op_forms(args.op_forms, setting)
    make_folder(out)  # before measuring: a bad --out must not cost the measurements
    opts = suite.BenchOptions(mixers, lengths, passes, setting, repeats, budget, ops,
                              args.peers, args.compile, out, args.quick, not args.no_progress,
                              command="", threads=threads, op_forms=op_forms,
                              overwrite=args.overwrite)
    return dataclasses.replace(opts, command=_command_line(opts))


def _command_line(opts: suite.BenchOptions) -> str:
    """The run's options spelled out in full, to repeat it exactly."""
    s = opts.setting
    parts = ["fastweights", "bench", "--mixers", ",".join(m[0] for m in opts.mixers) or "none",
             "--lengths", ",".join(map(str, opts.lengths)), "--d-model", str(s.d_model),
             "--n-heads", str(s.n_heads), "--batch", str(s.batch),
             "--dtype", str(s.dtype).removeprefix("torch."), "--device", str(s.device),
             "--repeats", str(opts.repeats), "--passes", ",".join(opts.passes),
             "--time-budget", f"{opts.time_budget:g}",
             "--threads", ",".join(map(str, opts.threads))]
    parts += [flag for flag, on in (("--ops", opts.ops), ("--peers", opts.peers),
                                    ("--compile", opts.compile)) if on]
    if opts.op_forms is not None:
        parts += ["--op-forms", ",".join(opts.op_forms)]
    return " ".join(shlex.quote(p) for p in parts)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "benchmark", None):
        return int(args.bench_run(args) or 0)
    from ..bench import suite

    suite.run(parse_options(args))
    return 0


def _fill_benchmark(name: str, parser: argparse.ArgumentParser) -> None:
    """A named benchmark's parser, from its module (imported now)."""
    module = bench.load(name)
    parser.description = module.DESCRIPTION
    module.add_arguments(parser)
    # The benchmark's own settings, as its results record them.
    parser.set_defaults(bench_run=module.run,
                        settings=[a.dest for a in parser._actions if a.dest != "help"])


def _add_benchmarks(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="benchmark", metavar="NAME", required=False,
                           parser_class=LazyParser,
                           title="focused benchmarks (fastweights bench NAME --help)")
    for name, help_line in bench.BENCHMARKS.items():
        sub.add_parser(name, help=help_line, formatter_class=HelpFormatter,
                       fill=functools.partial(_fill_benchmark, name))
