"""``fastweights bench ttt-mlp-backward``: TTT-MLP forward+backward with the hand-written
backward pass, against autograd through the same scan and against softmax attention
(``fastweights.bench.ttt_mlp_backward``)."""

from __future__ import annotations

import argparse
import json

from ...bench import ttt_mlp_backward
from ..common import parse_int_list, positive_int

NAME = "ttt-mlp-backward"
HELP = "TTT-MLP forward+backward: hand-written backward vs autograd vs softmax"
DESCRIPTION = ("Time one forward+backward of the ttt-mlp and softmax layers in thread CPU time, "
               "variants interleaved, and the bytes each keeps for the backward pass. Run with "
               "OMP_NUM_THREADS=1 for single-thread figures; --json also writes the numbers.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="4096", help="comma-separated T values")
    p.add_argument("--d-model", type=positive_int, default=512)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--group", type=positive_int, default=None,
                   help="also the TTT-MLP rows with checkpoint_group=GROUP")
    p.add_argument("--json", default=None, help="also write the results here")


def run(args: argparse.Namespace) -> int:
    results = ttt_mlp_backward.run(parse_int_list("--lengths", args.lengths),
                                   d_model=args.d_model, heads=args.heads,
                                   repeats=args.repeats, group=args.group)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
