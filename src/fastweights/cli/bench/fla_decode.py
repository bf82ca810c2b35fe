"""``fastweights bench fla-decode``: CPU decoding of fla's DeltaNet (on fastweights' ops) against a
transformers Llama of the same shape (``fastweights.bench.fla_decode``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from ...bench import fla_decode
from ..common import UserError, positive_int, recorded_settings

NAME = "fla-decode"
HELP = "CPU decoding of fla's DeltaNet vs a transformers Llama of the same shape"
DESCRIPTION = ("Decode with random-weight DeltaNet (fla's 340M / 1.3B shapes) and Llama models "
               "after a context of each length (synthetic state / KV cache, or a real prefill): "
               "state bytes, decode memory and tokens/s. Prints a Markdown table; --out writes "
               "JSON. --shapes tiny checks the command in seconds.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", choices=list(fla_decode.SHAPES), default=["340M", "1.3B"])
    p.add_argument("--models", nargs="+", choices=fla_decode.MODELS,
                   default=list(fla_decode.MODELS))
    p.add_argument("--dtypes", nargs="+", choices=list(fla_decode.DTYPES),
                   default=list(fla_decode.DTYPES))
    p.add_argument("--contexts", nargs="+", type=positive_int, default=[1024, 16384])
    p.add_argument("--new-tokens", type=positive_int, default=32)
    p.add_argument("--context-fill", choices=fla_decode.FILLS, default="synthetic",
                   help="synthetic: random state/KV cache of the context's shapes, no prefill "
                        "(default); prefill: run the context through the model first")
    p.add_argument("--prefill-chunk", type=positive_int, default=1024,
                   help="tokens per forward of the prefill (--context-fill prefill)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if "llama" in args.models and importlib.util.find_spec("transformers") is None:
        raise UserError("--models llama needs transformers (pip install 'fastweights[hf]')")
    rows = fla_decode.run(args.shapes, args.models, args.dtypes, args.contexts,
                          new_tokens=args.new_tokens, prefill_chunk=args.prefill_chunk,
                          seed=args.seed, fill=args.context_fill)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": recorded_settings(args),
                                        "machine": fla_decode.machine(), "results": rows},
                                       indent=2) + "\n")
    return 0
