"""``fastweights generate``: continue a text prompt with a checkpoint."""

from __future__ import annotations

import argparse

from ..tasks import ByteTokenizer
from ..train.checkpoint import load_model
from .common import UserError, user_errors

NAME = "generate"
HELP = "continue a text prompt with a checkpoint"
DESCRIPTION = "Prefill the prompt, then decode one byte per step from the recurrent state."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder or a training run folder")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest bytes "
                   "(default: all)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    with user_errors():
        model = load_model(args.checkpoint)
    tok = ByteTokenizer()
    ids = tok.encode(args.prompt)
    if ids.numel() == 0:
        raise UserError("--prompt must not be empty")
    if model.config.vocab_size != tok.vocab_size:
        raise UserError(f"the checkpoint's vocabulary ({model.config.vocab_size}) is not bytes (256)")
    with user_errors():
        out = model.generate(ids, args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, seed=args.seed)
    print(tok.decode(out))
    return 0
