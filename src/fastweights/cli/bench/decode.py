"""``fastweights bench decode``: decode memory and speed of a recurrent language model against
softmax attention (``fastweights.bench.decode``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ...bench import decode
from ..common import check_model_mixers, positive_int, recorded_settings

NAME = "decode"
HELP = "decode memory and speed of a recurrent LM vs softmax attention"
DESCRIPTION = ("Prefill a random context of each length, then decode one token per step: state "
               "bytes, their growth per token, the decode loop's peak resident memory and "
               "tokens/s, per mixer and context. Prints a table; --out writes JSON.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mixers", nargs="+", default=["delta", "softmax"])
    p.add_argument("--contexts", nargs="+", type=positive_int, default=[1024, 16384])
    p.add_argument("--d-model", type=positive_int, default=256)
    p.add_argument("--n-layers", type=positive_int, default=4)
    p.add_argument("--n-heads", type=positive_int, default=4)
    p.add_argument("--vocab-size", type=positive_int, default=256)
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument("--prefill-chunk", type=positive_int, default=1024)
    p.add_argument("--decode-mode", choices=["recurrent", "layer"], default="layer",
                   help="recurrent: T = 1 steps in the token-by-token form of mixers that have "
                        "one (same weights); layer: the mixers' configured form (chunk)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    check_model_mixers("--mixers", args.mixers, vocab_size=args.vocab_size, d_model=args.d_model,
                       n_layers=args.n_layers, n_heads=args.n_heads)
    rows = decode.run(args.mixers, args.contexts, d_model=args.d_model, n_layers=args.n_layers,
                      n_heads=args.n_heads, vocab_size=args.vocab_size,
                      new_tokens=args.new_tokens, prefill_chunk=args.prefill_chunk,
                      seed=args.seed, decode_mode=args.decode_mode)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": recorded_settings(args),
                                        "torch": torch.__version__, "results": rows}, indent=2))
    return 0
