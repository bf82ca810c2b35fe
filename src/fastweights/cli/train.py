"""``fastweights train``: train a language model on bytes or token ids; ``--resume`` continues a
run."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._commands import (
    CACHE_FOLDER,
    UserError,
    check_creatable,
    check_out,
    parse_mixer_list,
    positive_int,
    user_errors,
)
from .._names import FSDP_MIXED, RESUMABLE, TOKEN_DTYPES

if TYPE_CHECKING:
    from ..models import LMConfig
    from ..tasks.text import Corpus
    from ..train.records import RunRecord
    from ..train.trainer import TrainConfig


NAME = "train"


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


DESCRIPTION = (
    "Train a LanguageModel on bytes of --data (default: this Python's standard library source), "
    "on the token ids of a folder of pre-tokenized .bin files (--vocab-size), or on text "
    "tokenized once by --tokenizer into a cache folder (--token-cache). "
    "Writes run.json (every setting of the run), metrics.csv and atomic checkpoints "
    "(checkpoints/step-N, checkpoints/latest) into --out. Under torchrun, --batch-size is the "
    "global batch, split across processes. With --resume every setting comes from the run's "
    "run.json (its data included); of the options, only " + ", ".join(map(_flag, RESUMABLE))
    + " may change on resume (the new values are recorded); any other option that contradicts "
    "the run is refused. The learning-rate schedule is a function of the step and --steps, so a "
    "run extended with a larger --steps continues on the schedule of the new total. Ctrl-C "
    "(SIGINT) or SIGTERM saves a checkpoint of the last finished step and exits with 130 or 143; "
    "a second signal quits without waiting.")

# Command-line settings of `train` that are LMConfig fields of the same name (--mixer aside).
_MODEL_SETTINGS = ("d_model", "n_layers", "n_heads", "ffn", "glu_activation", "norm", "dropout",
                   "max_seq_len", "position")


def _setting(p: argparse.ArgumentParser, flag: str, default: object, text: str,
             shown: str | None = None, **kw) -> None:
    """A run setting: its argparse default is None so that ``train --resume`` can tell an option
    given on the command line from one left out (which then comes from run.json); ``default``,
    the value of a new run, is kept in the parser's ``setting_defaults`` and shown in --help
    (as ``shown`` when given)."""
    shown = str(default) if shown is None else shown
    action = p.add_argument(flag, default=None, help=f"{text} (default: {shown})".lstrip(), **kw)
    p.get_default("setting_defaults")[action.dest] = default


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.set_defaults(setting_defaults={})
    _setting(p, "--mixer", "delta",
             "one registered mixer for every layer, or a comma-separated list with one per layer; "
             "options as name:opt=value (e.g. delta:chunk_size=32)")
    _setting(p, "--data", "stdlib",
             "'stdlib' or a text file or folder; with --vocab-size a folder of pre-tokenized "
             "token files (train.bin and val.bin, or any *.bin files, split as text files are) "
             "or one .bin file")
    _setting(p, "--vocab-size", None,
             "token ids: --data holds raw little-endian ids below this (required for .bin data, "
             "checked before training); with --tokenizer, the model's vocabulary (at least the "
             "tokenizer's, to pad it)", shown="bytes, or the tokenizer's", type=positive_int)
    _setting(p, "--token-dtype", None, "the width of the ids in .bin files",
             shown="uint16 up to 65536 ids, else uint32", choices=list(TOKEN_DTYPES))
    _setting(p, "--tokenizer", None,
             "a local tokenizer.json file or transformers tokenizer folder: --data (text) is "
             "tokenized once into --token-cache and the model's vocabulary is the tokenizer's; "
             "run.json records the tokenizer's sha256, and --resume refuses another",
             shown="bytes", metavar="PATH")
    p.add_argument("--token-cache", default=None, metavar="DIR",
                   help="where --tokenizer writes tokenized corpora (folders tokens-<hash of the "
                   "tokenizer and the corpus files>, reused while the files are unchanged; "
                   "default: .fastweights-cache beside --out, or the run's own on --resume)")
    _setting(p, "--steps", 300, "optimiser steps (with --resume: the run's own unless given)",
             type=int)
    _setting(p, "--seq-len", 128, "", type=int)
    _setting(p, "--batch-size", 16, "global batch size of one forward and backward pass", type=int)
    _setting(p, "--grad-accum", 1,
             "gradient accumulation: K micro-batches of --batch-size rows per optimiser step "
             "(global batch --batch-size x K, exactly as one batch of that many rows; not with "
             "--carry-state; a resumed run keeps its K)", type=int, metavar="K")
    _setting(p, "--d-model", 128, "", type=int)
    _setting(p, "--n-layers", 2, "", type=int)
    _setting(p, "--n-heads", 4, "", type=int)
    _setting(p, "--ffn", "mlp", "", choices=["mlp", "glu", "none"])
    _setting(p, "--glu-activation", "silu",
             "the GLU's activation with --ffn glu (identity: TransNormer's published models)",
             choices=["silu", "gelu", "identity"])
    _setting(p, "--norm", "rmsnorm", "pre-norm of every block (srmsnorm: TransNormer's, no gain)",
             choices=["rmsnorm", "layernorm", "srmsnorm"])
    _setting(p, "--dropout", 0.0, "", type=float)
    _setting(p, "--max-seq-len", None,
             "longest sequence the model accepts (mixers with absolute position tables)",
             shown="no limit", type=int)
    _setting(p, "--position", "none",
             "absolute position encoding added to the embeddings (learned needs --max-seq-len)",
             choices=["none", "learned", "sinusoidal"])
    _setting(p, "--lr", 2e-3, "peak AdamW learning rate", type=float)
    _setting(p, "--warmup", 30, "linear warm-up steps before cosine decay", type=int)
    _setting(p, "--eval-every", 100, "validation period in steps", type=int)
    _setting(p, "--eval-windows", 64, "validation windows of --seq-len", type=int)
    _setting(p, "--save-every", 0, "checkpoint period (0: only at the end)", type=int)
    _setting(p, "--keep-last", None,
             "checkpoint retention: after each save, delete the checkpoints older than the K "
             "newest complete ones (the one checkpoints/latest names is always kept)",
             shown="keep every checkpoint", type=int, metavar="K")
    _setting(p, "--patience", 0, "stop after this many validations without a new best (0: never)",
             type=int)
    _setting(p, "--bf16", False, "bfloat16 autocast", action="store_true")
    _setting(p, "--anomaly-guard", False,
             "stop with an error when the loss or gradient norm becomes NaN or inf, before that "
             "step changes the weights (the last good checkpoint is kept)", action="store_true")
    _setting(p, "--pack", False,
             "pack each batch into one row with the state reset at document (file) boundaries "
             "(cu_seqlens), no padding and no prediction across documents", action="store_true")
    _setting(p, "--carry-state", False,
             "truncated backpropagation through time: each batch row reads consecutive windows "
             "of one long stream and starts from the previous step's state, detached (no "
             "truncation of the context; fixed-size-state mixers only, not with --pack)",
             action="store_true")
    _setting(p, "--reset-state", False,
             "with --carry-state: read the same stream segments in the same order but start "
             "every window from a fresh state (the control that separates the truncation from "
             "the data order)", action="store_true")
    _setting(p, "--recompute", False,
             "gradient checkpointing: keep only each block's input and recompute its activations "
             "in the backward pass (less memory, about one more forward)", action="store_true")
    _setting(p, "--seed", 0, "", type=int)
    p.add_argument("--context-parallel", type=positive_int, default=1, metavar="N",
                   help="under torchrun, split every sequence into N contiguous shards held by N "
                   "consecutive processes (world = N x data-parallel replicas); --seq-len must be "
                   "divisible by N and --pack is refused. A launch setting like the number of "
                   "processes: not recorded, a run may resume with another N")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun (2 or more processes), shard parameters, gradients and "
                   "AdamW's state over every process with FSDP2 (per block and at the root, on "
                   "one data x context-parallel device mesh) instead of replicating them (DDP); "
                   "checkpoints are then sharded (one file per process), and resume on any "
                   "number of processes, with or without --fsdp (a whole checkpoint resumes "
                   "under --fsdp too). A launch setting: not recorded")
    p.add_argument("--fsdp-mixed", choices=sorted(FSDP_MIXED), default=None,
                   help="with --fsdp: compute with bfloat16 parameters, keep float32 master "
                   "weights and reduce gradients in float32 (not with --bf16)")
    p.add_argument("--out", default="runs/train", help="run folder")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint (the newest older one "
                   "that verifies if it is damaged; step 0 if none was saved yet), with the run's "
                   "own settings")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run's outputs in --out (only once the new run is "
                   "checked and about to write)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def model_config(settings: dict[str, Any], vocab_size: int = 256) -> LMConfig:
    """The LMConfig of the run settings (``mixer`` as written on the command line); UserError for
    a bad mixer specification or config."""
    from ..models import LMConfig

    specs = parse_mixer_list("--mixer", settings["mixer"])
    names: str | list[str] = [n for n, _ in specs]
    options: dict[str, Any] | list[dict[str, Any]] = [o for _, o in specs]
    if len(specs) == 1:
        names, options = names[0], options[0]
    try:
        # LMConfig runs every layer's own option checks, before any output
        return LMConfig(vocab_size=vocab_size, mixer=names, mixer_options=options,
                        **{k: settings[k] for k in _MODEL_SETTINGS})
    except (TypeError, ValueError) as err:
        raise UserError(str(err).removeprefix("LMConfig.")) from None


def _recorded(dest: str, record: RunRecord) -> Any:
    """The run's value of the setting ``dest``, as the command line would spell it."""
    if dest == "data":
        return record.data
    if dest == "vocab_size":
        return record.model.vocab_size
    if dest in ("token_dtype", "tokenizer"):
        tokens = record.tokens
        if tokens is None or dest == "token_dtype":
            return None if tokens is None else tokens.dtype
        return tokens.tokenizer and f"{tokens.tokenizer}, sha256 {tokens.tokenizer_sha256[:12]}"
    if dest == "mixer":
        return ",".join(":".join([n, *(f"{k}={v}" for k, v in o.items())]) for n, o in zip(
            record.model.layer_mixers(), record.model.layer_options()))
    return getattr(record.model if dest in _MODEL_SETTINGS else record.train, dest)


def _agrees(dest: str, value: Any, record: RunRecord) -> bool:
    """Whether the option ``dest`` given as ``value`` names the run's own setting."""
    from ..tasks.tokens import tokenizer_sha256
    from ..train.records import same_data

    if dest == "data":
        return same_data(value, record.data)
    if dest == "tokenizer":  # the same tokenizer, wherever it is now
        tokens = record.tokens
        return tokens is not None and tokens.tokenizer_sha256 == tokenizer_sha256(value)
    if dest == "mixer":
        try:
            mine = model_config({**record.model.to_dict(), "mixer": value})
        except UserError:
            return False
        return (mine.layer_mixers(), mine.layer_options()) == (
            record.model.layer_mixers(), record.model.layer_options())
    return value == _recorded(dest, record)


def resume_settings(given: dict[str, Any], record: RunRecord) -> dict[str, Any]:
    """The training settings of ``train --resume``: the options ``given`` on the command line
    that may change on resume (``RESUMABLE``). Any other option given must agree with the
    record, else one UserError names every disagreement."""
    differ = [f"{_flag(dest)} {value} (the run has {_recorded(dest, record)})"
              for dest, value in given.items()
              if dest not in RESUMABLE and not _agrees(dest, value, record)]
    if differ:
        raise UserError(f"--resume: {'; '.join(differ)}: a resumed run keeps its own settings "
                        f"(only {', '.join(map(_flag, RESUMABLE))} may change); leave the "
                        "option out, or train a new run with another --out")
    return {k: given[k] for k in RESUMABLE if k in given}


def _data_name(spec: str) -> str:
    """``--data`` as recorded in run.json: an existing path made absolute, so that resuming or
    evaluating from another working folder reads the same corpus; else as given."""
    return spec if spec == "stdlib" or not Path(spec).exists() else str(Path(spec).resolve())


def _check_tokens(settings: dict[str, Any]) -> None:
    """The token options of a new run must agree with each other and the data (flag-named
    UserErrors, before anything is read)."""
    from ..tasks.tokens import is_token_folder

    data, vocab, dtype, tokenizer = (settings[k] for k in ("data", "vocab_size", "token_dtype",
                                                           "tokenizer"))
    if tokenizer is not None and not Path(tokenizer).exists():
        raise UserError(f"--tokenizer {tokenizer} does not exist (a tokenizer.json file or a "
                        "transformers tokenizer folder)")
    if tokenizer is not None and dtype is not None:
        raise UserError("--token-dtype is for pre-tokenized .bin data; with --tokenizer the "
                        "ids' width follows the tokenizer's vocabulary")
    if tokenizer is None and vocab is None:
        if dtype is not None:
            raise UserError("--token-dtype needs --vocab-size (pre-tokenized .bin data)")
        if data != "stdlib" and is_token_folder(data):
            raise UserError(f"--data {data} holds .bin token files: give --vocab-size (every "
                            "id is below it) to train on the token ids")


def _check_launch(args: argparse.Namespace, tcfg: TrainConfig, mcfg: LMConfig) -> None:
    """The settings that need no data must fit the launch (torchrun's WORLD_SIZE, 1 outside
    it): --fsdp, --fsdp-mixed, --context-parallel and the batch split, checked before the data
    is read (tokenizing it writes a cache) or the run folder is made."""
    from ..train.config import check_fsdp, check_launch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    with user_errors():
        check_launch(tcfg, mcfg, world, args.context_parallel)
        check_fsdp(args.fsdp, args.fsdp_mixed, world, tcfg)


def _configs(args: argparse.Namespace, main: bool
             ) -> tuple[LMConfig | None, TrainConfig, int | None, Callable[[], Corpus]]:
    """(model config, None on resume; training config; the model's vocabulary when an option
    sets it, else None: the data's; the loader of the run's data) of the run the options ask
    for. Nothing is read or written before every option is checked: --out is made by the
    trainer once the data and the first forward are checked too."""
    from ..tasks.tokens import open_corpus
    from ..train.records import run_corpus
    from ..train.trainer import RUN_FILE, TrainConfig, read_run

    out = Path(args.out)
    given = {k: getattr(args, k) for k in args.setting_defaults if getattr(args, k) is not None}
    progress = main and not args.quiet
    if args.resume:
        if args.overwrite:
            raise UserError("--resume continues the run in --out and --overwrite replaces it: "
                            "give one of them")
        if not (out / RUN_FILE).is_file():  # a run killed before its first save restarts at step 0
            raise UserError(f"--resume: {out} holds no training run to resume (no {RUN_FILE})")
        with user_errors():
            record = read_run(out)
            tcfg = dataclasses.replace(record.train, **resume_settings(given, record))
        _check_launch(args, tcfg, record.model)
        return None, tcfg, None, lambda: run_corpus(
            record, tokenizer=given.get("tokenizer"), cache_root=args.token_cache,
            progress=progress)
    settings = {**args.setting_defaults, **given}
    with user_errors():
        tcfg = TrainConfig(**{f.name: settings[f.name] for f in dataclasses.fields(TrainConfig)
                              if f.name in settings})
    mcfg = model_config(settings)
    _check_tokens(settings)
    _check_launch(args, tcfg, mcfg)
    if main:
        check_out(out, args.overwrite)  # the earlier run is replaced only by train() itself
        check_creatable(out)  # before the data is read: a bad --out must not cost tokenizing
    cache = args.token_cache or out.resolve().parent / CACHE_FOLDER
    tokenizer = settings["tokenizer"]
    return mcfg, tcfg, settings["vocab_size"], lambda: open_corpus(
        _data_name(settings["data"]), tokenizer=tokenizer,
        vocab_size=None if tokenizer is not None else settings["vocab_size"],
        token_dtype=settings["token_dtype"], cache_root=cache, progress=progress)


def run(args: argparse.Namespace) -> int:
    from ..train.checkpoint import CheckpointWriteError
    from ..train.trainer import TrainingAnomaly, TrainingInterrupted, train

    out = Path(args.out)
    main = int(os.environ.get("RANK", "0")) == 0
    mcfg, tcfg, vocab_size, load = _configs(args, main)
    with user_errors((ValueError, OSError)):
        corpus = load()
    if mcfg is not None:  # a new run: the model's vocabulary follows the data's
        with user_errors():
            mcfg = dataclasses.replace(mcfg, vocab_size=vocab_size or corpus.vocab_size)
    try:
        losses = train(out, mcfg, tcfg, corpus, resume=args.resume, overwrite=args.overwrite,
                       progress=not args.quiet, context_parallel=args.context_parallel,
                       fsdp=args.fsdp, fsdp_mixed=args.fsdp_mixed)
    except (ValueError, TrainingAnomaly, CheckpointWriteError) as err:
        raise UserError(str(err)) from None
    except OSError as err:  # writing run.json or metrics.csv (disk full, permissions)
        raise UserError(f"cannot write the run in {out}: {err}") from None
    except TrainingInterrupted as stop:
        if main:
            print(f"fastweights train: interrupted by {signal.Signals(stop.signum).name} after step "
                  f"{stop.step}; checkpoint {stop.checkpoint} saved; continue with "
                  f"fastweights train --out {out} --resume", file=sys.stderr)
        return 143 if stop.signum == signal.SIGTERM else 130
    if main:
        if losses:
            print(f"trained to step {losses[-1][0]}: last train loss {losses[-1][1]:.4f}; "
                  f"metrics in {out / 'metrics.csv'}, checkpoint in {out / 'checkpoints'}")
        else:
            print(f"the run in {out} has already trained its {tcfg.steps} steps; pass a larger "
                  "--steps to extend it")
    return 0
