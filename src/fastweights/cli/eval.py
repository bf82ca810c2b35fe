"""``fastweights eval``: validation loss, perplexity and bits per byte (or per token) of a
checkpoint."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .._commands import CACHE_FOLDER, UserError, positive_int, user_errors

if TYPE_CHECKING:
    from ..tasks.text import Corpus
    from ..train.records import RunRecord


NAME = "eval"
DESCRIPTION = ("Next-byte loss, perplexity and bits per byte of a checkpoint on the validation "
               "split of --data (by default the data of the run the checkpoint belongs to), "
               "printed as one JSON line. A model trained on token ids reads --data the same way "
               "(.bin files of ids, or text tokenized by its tokenizer: its run's, the one an "
               "exported folder carries, or --tokenizer) and reports bits per token instead. A "
               "model whose vocabulary does not fit the data's ids is refused (bytes are for a "
               "byte model only).")
BYTES = 256  # the vocabulary of a byte model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder or a training run folder")
    p.add_argument("--data", default=None,
                   help="'stdlib' or a text file or folder, or a folder of .bin token ids "
                   "(default: the data run.json of the checkpoint's training run names; 'stdlib' "
                   "for a folder outside a run)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a tokenizer.json file or transformers tokenizer folder that tokenizes "
                   "--data (default: the run's tokenizer, or the one the checkpoint folder "
                   "carries, which export --consolidate copies there; else bytes). Where the "
                   "model's own tokenizer is known, it must be that one")
    p.add_argument("--token-cache", default=None, metavar="DIR",
                   help="where text tokenized for the evaluation is cached (default: the run's "
                   f"token cache folder, else {CACHE_FOLDER} beside the checkpoint folder)")
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--windows", type=positive_int, default=64,
                   help="number of --seq-len windows evaluated")
    p.add_argument("--carry-state", action="store_true",
                   help="read the windows as one stream, carrying the recurrent state across them")


def run_record(checkpoint: str) -> RunRecord | None:
    """The record of the training run a checkpoint belongs to (a run folder, or a
    ``checkpoints/step-N`` folder in one): its run.json; None outside a run."""
    from ..train.trainer import RUN_FILE, read_run

    path = Path(checkpoint)
    for run_dir in (path, path.parent.parent):
        if (run_dir / RUN_FILE).is_file() and (run_dir == path or path.parent.name == "checkpoints"):
            try:
                return read_run(run_dir)
            except ValueError as err:
                raise UserError(f"{err}; pass --data") from None
    return None


def check_vocab(vocab: int, ids: int | None, what: str) -> None:
    """Ids from ``what`` must fit a model of vocabulary ``vocab``, else a UserError naming both:
    bytes (``ids`` None) fit a byte model only (256 ids: a token model reads any byte as a
    token id it was never trained on); a tokenizer's ``ids`` must not outnumber the model's
    (which may be larger: a run's --vocab-size pads its tokenizer's)."""
    if ids is None and vocab != BYTES:
        raise UserError(f"the checkpoint's vocabulary ({vocab} ids) does not fit {what} (bytes, "
                        f"{BYTES} ids): it was trained on token ids; pass --tokenizer PATH, the "
                        "tokenizer that made them")
    if ids is not None and ids > vocab:
        raise UserError(f"the checkpoint's vocabulary ({vocab} ids) does not fit {what} "
                        f"({ids} ids)")


def _carried(checkpoint: str, given: str | None) -> str | None:
    """The tokenizer of a model outside a run: ``given`` (--tokenizer), which must be the one
    the checkpoint folder carries when it carries one (same hash), else the carried one; None:
    bytes or ids."""
    from ..tasks.tokens import carried_tokenizer, tokenizer_sha256

    carried = carried_tokenizer(checkpoint)
    if carried is None:
        return given
    if given is None:
        return str(carried)
    with user_errors():
        mine, theirs = tokenizer_sha256(carried), tokenizer_sha256(given)
    if mine != theirs:
        raise UserError(f"--tokenizer {given} is not the tokenizer {carried} the checkpoint "
                        f"carries (sha256 {theirs[:12]}, it carries {mine[:12]}): its ids would "
                        "differ from the ones the model was trained on")
    return given


def own_tokenizer(checkpoint: str, record: RunRecord | None, given: str | None) -> str | None:
    """The path of the tokenizer the checkpoint's ids come from: ``given`` (--tokenizer), which
    must be the model's own where that is known, else the model's own: its run's (at the
    recorded path, with the recorded sha256) or the one its folder carries (``export
    --consolidate`` copies it there). None for bytes, and for a run on .bin ids without
    ``given``. UserError for --tokenizer on a byte run, or a tokenizer that is missing or not
    the model's."""
    from ..tasks.tokens import tokenizer_sha256

    if record is None:
        return _carried(checkpoint, given)
    tokens = record.tokens
    if tokens is None:
        if given is not None:
            raise UserError("--tokenizer: the checkpoint's run was trained on bytes")
        return None
    if tokens.tokenizer_sha256 is None:  # .bin ids: the tokenizer that made them is unrecorded
        return given
    path = given if given is not None else tokens.tokenizer
    if not Path(path).exists():
        raise UserError(f"the run's tokenizer {path} does not exist: pass --tokenizer PATH, a "
                        "copy of it")
    with user_errors():
        sha = tokenizer_sha256(path)
    if sha != tokens.tokenizer_sha256:
        raise UserError(f"tokenizer {path} is not the run's (sha256 {sha[:12]}, the run has "
                        f"{tokens.tokenizer_sha256[:12]}): its ids would differ from the ones "
                        "the model was trained on")
    return path


def _corpus(args: argparse.Namespace, record: RunRecord | None, vocab: int) -> Corpus:
    """The evaluation's data, its vocabulary checked against the model's (``vocab``) before it
    is read or tokenized: the run's kind of data as the run read it (``run_corpus``: bytes,
    .bin ids, or text by its tokenizer into its cache); outside a run (or with --tokenizer for
    a run on .bin ids) a folder of .bin ids as the model's ids, text by the model's tokenizer,
    else bytes."""
    from ..tasks.tokens import is_token_folder, load_tokenizer, open_corpus
    from ..train.records import run_corpus

    progress = sys.stderr.isatty()
    tokens = None if record is None else record.tokens
    path = own_tokenizer(args.checkpoint, record, args.tokenizer)
    if record is not None and (path is None or tokens.source == "tokenizer"):
        check_vocab(vocab, None if tokens is None else tokens.vocab_size, "the run's data")
        with user_errors((ValueError, OSError)):
            return run_corpus(record, data=args.data, tokenizer=path,
                              cache_root=args.token_cache, progress=progress)
    data = args.data or (record.data if record is not None else "stdlib")
    if data != "stdlib" and is_token_folder(data):
        if args.tokenizer is not None:
            raise UserError(f"--tokenizer tokenizes text, but --data {data} holds .bin token ids")
        with user_errors((ValueError, OSError)):
            return open_corpus(data, vocab_size=vocab)  # every id checked below the model's
    if path is None:
        check_vocab(vocab, None, f"--data {data}")
        with user_errors((ValueError, OSError)):
            return open_corpus(data)
    with user_errors():
        tok = load_tokenizer(path)
    check_vocab(vocab, tok.vocab_size, f"tokenizer {path}")
    cache = args.token_cache or Path(args.checkpoint).resolve().parent / CACHE_FOLDER
    with user_errors((ValueError, OSError)):
        return open_corpus(data, tokenizer=tok, cache_root=cache, progress=progress)


def run(args: argparse.Namespace) -> int:
    from ..train.checkpoint import load_model
    from ..train.trainer import evaluate

    with user_errors():
        model = load_model(args.checkpoint)
    limit = model.config.max_seq_len
    if limit is not None and (args.seq_len > limit
                              or (args.carry_state and args.seq_len * args.windows > limit)):
        raise UserError(f"the model supports sequences of at most {limit} tokens (max_seq_len)")
    corpus = _corpus(args, run_record(args.checkpoint), model.config.vocab_size)
    with user_errors():
        loss = evaluate(model, corpus.val, args.seq_len, args.windows, carry_state=args.carry_state)
    result = {"checkpoint": str(args.checkpoint), "data": corpus.name, "seq_len": args.seq_len,
              "windows": args.windows, "carry_state": args.carry_state, "loss": loss,
              "perplexity": math.exp(loss),
              ("bits_per_byte" if corpus.tokens is None else "bits_per_token"): loss / math.log(2)}
    print(json.dumps(result))
    return 0
