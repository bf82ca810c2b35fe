"""``fastweights bench gated-delta``: CPU time of ``gated_delta_rule`` (chunked forward,
forward+backward, the one-token step) next to our ``delta_rule`` and transformers' PyTorch
fallbacks, in one process (``fastweights.bench.gated_delta``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...bench import gated_delta
from ..common import (
    command_line,
    parse_int_list,
    parse_name_list,
    positive_int,
    prepare_out,
    recorded_settings,
    user_errors,
)

NAME = "gated-delta"
HELP = "gated_delta_rule vs delta_rule and transformers' fallbacks on CPU"
DESCRIPTION = ("Time gated_delta_rule's chunked form (forward, and forward+backward into q, k, "
               "v, beta, g) at each chunk size and its one-token step, next to delta_rule and "
               "transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule "
               "(Qwen3.5's PyTorch fallbacks; rows skipped where transformers is not installed), "
               "in interleaved rounds at each thread count; B, T, H, D float32, k L2-normalised. "
               "Prints the tables; with --out writes results.md, results.csv, meta.json and "
               "lscpu.txt there.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--T", type=positive_int, default=4096, help="tokens")
    p.add_argument("--B", type=positive_int, default=1, help="batch")
    p.add_argument("--H", type=positive_int, default=8, help="heads")
    p.add_argument("--D", type=positive_int, default=64, help="head dim (Dk = Dv)")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts, run "
                                                    "one after another")
    p.add_argument("--chunk-sizes", default="64,32",
                   help="comma-separated chunk sizes; the first is the ratios' reference")
    p.add_argument("--passes", default=",".join(gated_delta.PASSES),
                   help=f"comma-separated, some of {', '.join(gated_delta.PASSES)}")
    p.add_argument("--repeats", type=positive_int, default=7, help="timed rounds")
    p.add_argument("--step-calls", type=positive_int, default=100,
                   help="one-token calls per timed sample of the step pass")
    add_out_arguments(p)


def add_out_arguments(p: argparse.ArgumentParser) -> None:
    """--out and --overwrite of the gated-delta benchmarks (this one and gated-delta-models)."""
    p.add_argument("--out", type=Path, default=None,
                   help="folder for results.md, results.csv, meta.json and lscpu.txt "
                        "(default: print only)")
    p.add_argument("--overwrite", action="store_true", help="replace results already in --out")


def prepare(args: argparse.Namespace) -> None:
    """Before any timing: --out made ready (refused if it holds results, unless --overwrite)."""
    if args.out is not None:
        prepare_out(args.out, args.overwrite, gated_delta.OUTPUT_FILES)


def report(args: argparse.Namespace, name: str, rows: list[Any],
           record: Callable[[list[Any], dict[str, Any], str], tuple[list[str], dict[str, Any]]],
           ) -> None:
    """Print the run's tables (``record``: the benchmark's report of its rows) and, with --out,
    write them with the settings and the command ``fastweights bench {name} ...``."""
    lines, meta = record(rows, recorded_settings(args),
                         command_line(["fastweights", "bench", name], args))
    print("\n".join(lines))
    if args.out is not None:
        gated_delta.write_record(args.out, lines, meta, rows)


def run(args: argparse.Namespace) -> int:
    threads = parse_int_list("--threads", args.threads)
    chunk_sizes = parse_int_list("--chunk-sizes", args.chunk_sizes)
    passes = parse_name_list("--passes", args.passes, gated_delta.PASSES)
    prepare(args)
    with user_errors((ValueError,)):
        rows = gated_delta.run_gated_delta(
            T=args.T, B=args.B, H=args.H, D=args.D, threads=tuple(threads),
            chunk_sizes=tuple(chunk_sizes), passes=passes, repeats=args.repeats,
            step_calls=args.step_calls)
    report(args, NAME, rows, gated_delta.record)
    return 0
