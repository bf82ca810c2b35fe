"""``fastweights bench fsdp``: memory per rank and bytes communicated per training step of one
model under one process, DDP and FSDP on N processes (``fastweights.bench.fsdp``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...bench import fsdp
from ..common import command_line, parse_int_list, parse_mixer_spec, positive_int, user_errors

NAME = "fsdp"
HELP = "FSDP vs DDP: model state and peak memory per rank, bytes moved, largest model per rank"
DESCRIPTION = ("One language model's training step (AdamW) on one process, and under DDP and "
               "FSDP (fastweights train --fsdp) on N processes (gloo, CPU) for N in --world: "
               "model state (parameters, gradients, AdamW moments) and peak resident memory per "
               "rank, bytes through the collectives per rank and step, and the largest model "
               "one rank of --memory-gib fits (extrapolated). Writes results.csv, summary.md "
               "and run.json into --out.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", default="1,2,4", help="comma-separated process counts N")
    p.add_argument("--mixer", default="delta", help="the mixer of every layer (name or name:opt=value)")
    p.add_argument("--d-model", type=positive_int, default=768)
    p.add_argument("--n-layers", type=positive_int, default=14)
    p.add_argument("--n-heads", type=positive_int, default=12)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    p.add_argument("--memory-gib", type=float, default=24.0,
                   help="memory of one rank, for the largest model")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    p.add_argument("--out", type=Path, required=True)


def run(args: argparse.Namespace) -> int:
    worlds = parse_int_list("--world", args.world)
    name, options = parse_mixer_spec("--mixer", args.mixer)
    model = {"d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads,
             "mixer": name, "mixer_options": options}
    with user_errors((TypeError, ValueError)):
        fsdp.run(worlds, args.out, model=model, batch=args.batch, seq_len=args.seq_len,
                 threads=args.threads, memory_gib=args.memory_gib, timeout=args.timeout,
                 command=command_line(["fastweights", "bench", NAME], args))
    return 0
