"""``fastweights bench multistream``: decoding many streams at once, each at its own position,
every recurrent mixer against softmax with a KV cache (``fastweights.bench.multistream``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ...bench import multistream
from ...models.registry import check_mixer, mixer_names
from ..common import (
    UserError,
    command_line,
    parse_int_list,
    parse_mixer_spec,
    positive_int,
    user_errors,
)

NAME = "multistream"
HELP = "decoding N streams at their own positions in one batched step, vs softmax"
DESCRIPTION = ("One decoding step of N streams stacked with LanguageModel.stack_states, per mixer, "
               "context and N, eager and compiled: ms per step, tokens/s, state and step-peak "
               "memory per stream (synthetic contexts: no long prefill). Writes results.csv, "
               "results.md and meta.json into --out.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    default_mixers = ",".join(m for m in mixer_names() if m != "aft-full")
    p.add_argument("--mixers", default=default_mixers,
                   help="comma-separated mixer specs (name or name:opt=value); softmax, the "
                        "baseline, is added unless named (default: every mixer but aft-full)")
    p.add_argument("--streams", default="1,8,64", help="stream counts N")
    p.add_argument("--contexts", default="1024,16384", help="context lengths c")
    p.add_argument("--compile", default="both", choices=list(multistream.COMPILE_CHOICES))
    p.add_argument("--d-model", type=positive_int, default=512)
    p.add_argument("--n-layers", type=positive_int, default=4)
    p.add_argument("--n-heads", type=positive_int, default=8)
    p.add_argument("--vocab-size", type=positive_int, default=256)
    p.add_argument("--steps", type=positive_int, default=8, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first call")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--overwrite", action="store_true", help="replace results already in --out")


def run(args: argparse.Namespace) -> int:
    streams = parse_int_list("--streams", args.streams)
    contexts = parse_int_list("--contexts", args.contexts)
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    specs = []
    for text in (t.strip() for t in args.mixers.split(",") if t.strip()):
        name, opts = parse_mixer_spec("--mixers", text)
        with user_errors((ValueError, TypeError), prefix=f"--mixers {text!r}: "):
            check_mixer(name, args.d_model, args.n_heads, **opts)
        specs.append((text, name, opts))
    existing = [f for f in multistream.OUTPUT_FILES if (args.out / f).exists()]
    if existing and not args.overwrite:
        raise UserError(f"--out {args.out} already holds {', '.join(existing)}; pass --overwrite")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    multistream.run(specs, streams, contexts, args.out,
                    modes=multistream.COMPILE_CHOICES[args.compile], d_model=args.d_model,
                    n_layers=args.n_layers, n_heads=args.n_heads, vocab_size=args.vocab_size,
                    steps=args.steps, warmup=args.warmup, device=args.device, seed=args.seed,
                    command=command_line(["fastweights", "bench", NAME], args))
    return 0
