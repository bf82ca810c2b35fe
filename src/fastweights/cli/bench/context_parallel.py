"""``fastweights bench context-parallel``: one layer's training step on one sequence split over N
processes: time, peak memory per rank, bytes communicated (``fastweights.bench.context_parallel``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...bench import context_parallel
from ...models.registry import mixer_names
from ..common import (
    UserError,
    command_line,
    parse_int_list,
    parse_mixer_spec,
    positive_int,
    user_errors,
)

NAME = "context-parallel"
HELP = "context parallelism: step time, memory per rank, bytes moved, vs N"
DESCRIPTION = ("One layer's training step (forward + backward) on one sequence of T tokens split "
               "over N processes (gloo, CPU), for N in --world and T in --lengths: time per "
               "step, peak memory per rank, bytes communicated per layer, and the longest T one "
               "machine of --memory-gib fits. Writes results.csv, longest_T.csv, summary.md and "
               "run.json into --out.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", default="1,2,4", help="comma-separated process counts N")
    p.add_argument("--lengths", default="1024,2048,4096", help="comma-separated total T")
    p.add_argument("--mixers", default=",".join(mixer_names()),
                   help="comma-separated mixer specs (name or name:opt=value)")
    p.add_argument("--d-model", type=positive_int, default=256)
    p.add_argument("--n-heads", type=positive_int, default=4)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    p.add_argument("--memory-gib", type=float, default=24.0, help="machine budget for longest T")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    p.add_argument("--out", type=Path, required=True)


def run(args: argparse.Namespace) -> int:
    worlds = parse_int_list("--world", args.world)
    lengths = parse_int_list("--lengths", args.lengths)
    mixers = [(m, *parse_mixer_spec("--mixers", m)) for m in args.mixers.split(",") if m]
    if not mixers:
        raise UserError(f"--mixers: no mixer given in {args.mixers!r}")
    with user_errors((TypeError, ValueError), prefix="--mixers "):
        context_parallel.check(mixers, lengths, worlds, d_model=args.d_model,
                               n_heads=args.n_heads)
    context_parallel.run(mixers, lengths, worlds, args.out, d_model=args.d_model,
                         n_heads=args.n_heads, batch=args.batch, repeats=args.repeats,
                         threads=args.threads, memory_gib=args.memory_gib, timeout=args.timeout,
                         command=command_line(["fastweights", "bench", NAME], args))
    return 0
