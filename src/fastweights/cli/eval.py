"""``fastweights eval``: validation loss, perplexity and bits per byte of a checkpoint."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from ..tasks import load_corpus
from ..train.checkpoint import load_model
from ..train.trainer import RUN_FILE, evaluate, read_run
from .common import UserError, positive_int, user_errors

NAME = "eval"
HELP = "validation perplexity of a checkpoint"
DESCRIPTION = ("Next-byte loss, perplexity and bits per byte of a checkpoint on the validation "
               "split of --data (by default the data of the run the checkpoint belongs to), "
               "printed as one JSON line.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder or a training run folder")
    p.add_argument("--data", default=None,
                   help="'stdlib' or a text file or folder (default: the data run.json of the "
                   "checkpoint's training run names; 'stdlib' for a folder outside a run)")
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--windows", type=positive_int, default=64,
                   help="number of --seq-len windows evaluated")
    p.add_argument("--carry-state", action="store_true",
                   help="read the windows as one stream, carrying the recurrent state across them")


def run_data(checkpoint: str) -> str:
    """The data of the training run a checkpoint belongs to (a run folder, or a
    ``checkpoints/step-N`` folder in one): what its run.json records; 'stdlib' outside a run."""
    path = Path(checkpoint)
    for run_dir in (path, path.parent.parent):
        if (run_dir / RUN_FILE).is_file() and (run_dir == path or path.parent.name == "checkpoints"):
            try:
                return read_run(run_dir).data
            except ValueError as err:
                raise UserError(f"{err}; pass --data") from None
    return "stdlib"


def run(args: argparse.Namespace) -> int:
    with user_errors():
        model = load_model(args.checkpoint)
    limit = model.config.max_seq_len
    if limit is not None and (args.seq_len > limit
                              or (args.carry_state and args.seq_len * args.windows > limit)):
        raise UserError(f"the model supports sequences of at most {limit} tokens (max_seq_len)")
    with user_errors((ValueError, OSError)):
        corpus = load_corpus(args.data if args.data is not None else run_data(args.checkpoint))
    with user_errors():
        loss = evaluate(model, corpus.val, args.seq_len, args.windows, carry_state=args.carry_state)
    result = {"checkpoint": str(args.checkpoint), "data": corpus.name, "seq_len": args.seq_len,
              "windows": args.windows, "carry_state": args.carry_state, "loss": loss,
              "perplexity": math.exp(loss), "bits_per_byte": loss / math.log(2)}
    print(json.dumps(result))
    return 0
