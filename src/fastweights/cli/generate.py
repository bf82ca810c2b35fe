"""``fastweights generate``: continue a text prompt with a checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .._commands import UserError, user_errors
from .eval import check_vocab, run_record

NAME = "generate"
DESCRIPTION = ("Prefill the prompt, then decode one token per step from the recurrent state. "
               "Tokens are bytes, or the ids of the tokenizer the checkpoint's run was trained "
               "with (its recorded path, checked against its recorded sha256), of the one an "
               "exported checkpoint folder carries, or of --tokenizer.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder or a training run folder")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest bytes "
                   "(default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the model decodes, e.g. cuda "
                   "(default: cpu); on CUDA the step is captured once as a CUDA graph and "
                   "replayed per token where every mixer has a static form (--graph)")
    p.add_argument("--graph", choices=["auto", "on", "off"], default="auto",
                   help="decode through a CUDA graph of the step: auto (on CUDA where every "
                   "mixer allows it), on (required), off")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a tokenizer.json file or transformers tokenizer folder that encodes the "
                   "prompt and decodes the output (default: the run's tokenizer, or the one the "
                   "checkpoint folder carries, else bytes; "
                   "required for a run trained on pre-tokenized .bin files)")


def _tokenizer(args: argparse.Namespace) -> Any:
    """--tokenizer, else the tokenizer of the checkpoint's run (its hash must be the recorded
    one) or the one the checkpoint folder carries, else bytes; UserError for a run on .bin ids
    without --tokenizer."""
    from ..tasks import ByteTokenizer
    from ..tasks.tokens import carried_tokenizer, load_tokenizer

    path = args.tokenizer
    if path is None:
        record = run_record(args.checkpoint)
        tokens = None if record is None else record.tokens
        carried = carried_tokenizer(args.checkpoint) if record is None else None
        if tokens is None and carried is None:
            return ByteTokenizer()
        if carried is not None:
            with user_errors():
                return load_tokenizer(carried)
        if tokens.tokenizer is None:
            raise UserError("the checkpoint's run was trained on pre-tokenized .bin ids: pass "
                            "--tokenizer PATH, the tokenizer that made them")
        path = tokens.tokenizer
        if not Path(path).exists():
            raise UserError(f"the run's tokenizer {path} does not exist: pass --tokenizer PATH")
    with user_errors():
        tok = load_tokenizer(path)
    if args.tokenizer is None and tok.sha256 != tokens.tokenizer_sha256:
        raise UserError(f"the run's tokenizer {path} has changed since training (sha256 "
                        f"{tok.sha256[:12]}, the run has {tokens.tokenizer_sha256[:12]}): pass "
                        "--tokenizer PATH to use it anyway")
    return tok


def run(args: argparse.Namespace) -> int:
    import torch

    from ..tasks import ByteTokenizer
    from ..train.checkpoint import load_model

    with user_errors((ValueError, RuntimeError), prefix="--device: "):
        device = torch.device(args.device)
        torch.empty(0, device=device)  # a device this torch cannot use fails here, in one line
    with user_errors():
        model = load_model(args.checkpoint).to(device)
    tok = _tokenizer(args)
    ids = tok.encode(args.prompt).to(model.embed.weight.device)
    if ids.numel() == 0:
        raise UserError("--prompt must not be empty")
    bytes_ = isinstance(tok, ByteTokenizer)
    check_vocab(model.config.vocab_size, None if bytes_ else tok.vocab_size,
                "--prompt" if bytes_ else f"tokenizer {tok.path}")
    with user_errors():
        out = model.generate(ids, args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, seed=args.seed,
                             graph={"auto": None, "on": True, "off": False}[args.graph])
    print(tok.decode(out.cpu()))
    return 0
