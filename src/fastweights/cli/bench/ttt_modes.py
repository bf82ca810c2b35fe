"""``fastweights bench ttt-modes``: CPU time of the TTT dual form against the vectorised primal
form (``fastweights.bench.ttt_modes``)."""

from __future__ import annotations

import argparse
import json

import torch

from ...bench import ttt_modes
from ..common import positive_int

NAME = "ttt-modes"
HELP = "CPU time of the TTT dual form vs the primal form"
DESCRIPTION = ("Time ttt_linear and ttt_mlp in both modes, forward alone and forward + backward "
               "(median of --repeats after a warm-up), and their float64 disagreement on a "
               "shorter sequence. Prints a table; --json also writes the numbers. On a shared "
               "machine run it with OMP_WAIT_POLICY=passive.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--seq-len", type=positive_int, default=2048)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--mini-batch-size", type=positive_int, default=16)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: torch's)")
    p.add_argument("--ops", nargs="+", choices=list(ttt_modes.OPS), default=list(ttt_modes.OPS))
    p.add_argument("--json", type=str, default=None, help="also write the results here")


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results = ttt_modes.run(args.ops, batch=args.batch, heads=args.heads, seq_len=args.seq_len,
                            head_dim=args.head_dim, mini_batch_size=args.mini_batch_size,
                            repeats=args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
