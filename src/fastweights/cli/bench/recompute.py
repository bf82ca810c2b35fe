"""``fastweights bench recompute``: training-step time and peak memory with and without gradient
checkpointing (``fastweights.bench.recompute``)."""

from __future__ import annotations

import argparse

import torch

from ...bench import recompute
from ..common import check_model_mixers, command_line, parse_int_list, positive_int

NAME = "recompute"
HELP = "training-step time and peak memory with and without recompute"
DESCRIPTION = ("Time one training step (forward, loss, backward) of a LanguageModel per mixer "
               "and length with gradient checkpointing off and on, and the peak memory it adds; "
               "checks the losses agree. Prints a table; --out writes results.json and "
               "results.md.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mixers", default="delta,linear,softmax", help="comma-separated mixer names")
    p.add_argument("--lengths", default="1024,4096", help="comma-separated T values")
    p.add_argument("--d-model", type=positive_int, default=512)
    p.add_argument("--n-layers", type=positive_int, default=4)
    p.add_argument("--n-heads", type=positive_int, default=8)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="folder for results.json and results.md")


def run(args: argparse.Namespace) -> int:
    mixers = [m for m in args.mixers.split(",") if m]
    check_model_mixers("--mixers", mixers, vocab_size=256, d_model=args.d_model,
                       n_layers=args.n_layers, n_heads=args.n_heads)
    recompute.run(mixers,
                  parse_int_list("--lengths", args.lengths), d_model=args.d_model,
                  n_layers=args.n_layers, n_heads=args.n_heads, repeats=args.repeats,
                  device=args.device, out=args.out,
                  command=command_line(["fastweights", "bench", NAME], args))
    return 0
