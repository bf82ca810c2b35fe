"""``fastweights bench gated-delta-models``: transformers' Qwen3.5 gated-delta layer and a small
Qwen3.5-shaped model on CPU, transformers' PyTorch fallbacks against ``use_fastweights``
(``fastweights.bench.gated_delta_models``)."""

from __future__ import annotations

import argparse

from ...bench import gated_delta_models
from ..common import parse_int_list, parse_name_list, positive_int, user_errors
from .gated_delta import add_out_arguments, prepare, report

NAME = "gated-delta-models"
HELP = "Qwen3.5's gated-delta layer and a small model: transformers' fallbacks vs use_fastweights"
DESCRIPTION = ("Time transformers' Qwen3_5GatedDeltaNet layer at Qwen3.5's head layout (16 key / "
               "32 value heads of 128) on a T-token prefill and a one-token decode, and a "
               "random-weight Qwen3_5ForCausalLM's prefill and greedy-decode tokens/s, each with "
               "transformers' PyTorch fallbacks and after fastweights.hf.use_fastweights, in "
               "interleaved rounds on the CPU. Needs the [hf] extra (transformers). Prints the "
               "table; with --out writes results.md, results.csv, meta.json and lscpu.txt there.")
CASES = ("layer", "model")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--T", default="1024,4096", help="comma-separated layer prefill lengths")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help=f"comma-separated, some of {', '.join(gated_delta_models.DTYPES)}")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma-separated, some of {', '.join(CASES)}")
    p.add_argument("--hidden", type=positive_int, default=1024, help="hidden size")
    p.add_argument("--layers", type=positive_int, default=4,
                   help="model layers (every fourth full attention, as in Qwen3.5)")
    p.add_argument("--vocab", type=positive_int, default=8192, help="model vocabulary size")
    p.add_argument("--model-T", type=positive_int, default=1024, help="model prefill length")
    p.add_argument("--new-tokens", type=positive_int, default=32,
                   help="tokens the model decodes greedily after an 8-token prompt")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed rounds")
    p.add_argument("--decode-calls", type=positive_int, default=20,
                   help="one-token layer calls per timed sample of the layer decode")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads")
    add_out_arguments(p)


def run(args: argparse.Namespace) -> int:
    Ts = parse_int_list("--T", args.T)
    dtypes = parse_name_list("--dtypes", args.dtypes, tuple(gated_delta_models.DTYPES))
    cases = parse_name_list("--cases", args.cases, CASES)
    prepare(args)
    with user_errors((ValueError, ImportError)):
        rows = gated_delta_models.run_gated_delta_models(
            Ts=tuple(Ts), dtypes=dtypes, hidden=args.hidden, layers=args.layers,
            vocab=args.vocab, model_T=args.model_T, new_tokens=args.new_tokens,
            repeats=args.repeats, decode_calls=args.decode_calls, threads=args.threads,
            cases=cases)
    report(args, NAME, rows, gated_delta_models.record)
    return 0
