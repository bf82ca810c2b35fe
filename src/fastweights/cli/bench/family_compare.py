"""``fastweights bench family-compare``: forward + backward time of the TransNormer / AFT /
Infini-attention mixers against softmax attention (``fastweights.bench.family_compare``)."""

from __future__ import annotations

import argparse

from ...bench import family_compare
from ..common import positive_int

NAME = "family-compare"
HELP = "forward+backward time of the TransNormer / AFT / Infini mixers vs softmax"
DESCRIPTION = ("Time one forward+backward call of each mixer (registry defaults, float32) in "
               "interleaved rounds after a warm-up; prints the minimum and median per mixer and "
               "the ratio of minima to softmax.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mixers", nargs="+", default=list(family_compare.DEFAULT_MIXERS),
                   help="registered mixer names")
    p.add_argument("--lengths", nargs="+", type=positive_int, default=[1024, 4096],
                   help="sequence lengths T")
    p.add_argument("--d-model", type=positive_int, default=512)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> int:
    family_compare.run(args.mixers, args.lengths, d_model=args.d_model, heads=args.heads,
                       batch=args.batch, repeats=args.repeats, device=args.device)
    return 0
