"""``fastweights eval``: validation loss, perplexity and bits per byte (or per token) of a
checkpoint."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .._commands import UserError, positive_int, user_errors
from ..tasks.tokens import is_token_folder, open_corpus
from ..train.checkpoint import load_model
from ..train.records import RunRecord, run_corpus
from ..train.trainer import RUN_FILE, evaluate, read_run

NAME = "eval"
HELP = "validation perplexity of a checkpoint"
DESCRIPTION = ("Next-byte loss, perplexity and bits per byte of a checkpoint on the validation "
               "split of --data (by default the data of the run the checkpoint belongs to), "
               "printed as one JSON line. A run trained on token ids reads --data the same way "
               "(its .bin files, or text tokenized by its tokenizer into its token cache) and "
               "reports bits per token instead.")


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


def run_record(checkpoint: str) -> RunRecord | None:
    """The record of the training run a checkpoint belongs to (a run folder, or a
    ``checkpoints/step-N`` folder in one): its run.json; None outside a run."""
    path = Path(checkpoint)
    for run_dir in (path, path.parent.parent):
        if (run_dir / RUN_FILE).is_file() and (run_dir == path or path.parent.name == "checkpoints"):
            try:
                return read_run(run_dir)
            except ValueError as err:
                raise UserError(f"{err}; pass --data") from None
    return None


def run(args: argparse.Namespace) -> int:
    with user_errors():
        model = load_model(args.checkpoint)
    limit = model.config.max_seq_len
    if limit is not None and (args.seq_len > limit
                              or (args.carry_state and args.seq_len * args.windows > limit)):
        raise UserError(f"the model supports sequences of at most {limit} tokens (max_seq_len)")
    record = run_record(args.checkpoint)
    with user_errors((ValueError, OSError)):
        if record is None:  # a checkpoint outside a run: a .bin folder holds the model's ids
            data = args.data or "stdlib"
            corpus = open_corpus(data, vocab_size=model.config.vocab_size
                                 if data != "stdlib" and is_token_folder(data) else None)
        else:
            corpus = run_corpus(record, data=args.data, progress=sys.stderr.isatty())
    with user_errors():
        loss = evaluate(model, corpus.val, args.seq_len, args.windows, carry_state=args.carry_state)
    result = {"checkpoint": str(args.checkpoint), "data": corpus.name, "seq_len": args.seq_len,
              "windows": args.windows, "carry_state": args.carry_state, "loss": loss,
              "perplexity": math.exp(loss),
              ("bits_per_byte" if corpus.tokens is None else "bits_per_token"): loss / math.log(2)}
    print(json.dumps(result))
    return 0
