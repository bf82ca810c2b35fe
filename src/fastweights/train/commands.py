"""Implementations of the ``fastweights`` subcommands (cli.py holds only their arguments).

Every user mistake raises ``UserError`` (one stderr line, exit 2)."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ..cli import UserError, make_folder
from .specs import SpecError, parse_int_list, parse_mixer_list


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that is a file, or a non-empty folder unless ``overwrite``; changes
    nothing."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out} already holds results of an earlier run; "
                        "pass --overwrite or choose another folder")


def prepare_out(out: Path, overwrite: bool, outputs: tuple[str, ...]) -> None:
    """Create ``out`` (``check_out`` first); with ``overwrite`` an earlier run's ``outputs``
    (the files and folders the command writes) are deleted, never anything else a mistyped
    ``--out`` might hold. Call it once everything else is validated."""
    check_out(out, overwrite)
    for name in outputs if overwrite else ():
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    make_folder(out)


def cmd_recall(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..models.registry import mixer_names
    from ..models.retrieval import MEMORIES
    from ..reproduce import recall

    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    for t in tasks:
        if t not in recall.TASKS:
            raise UserError(f"unknown --task {t!r}; choose from {', '.join(recall.TASKS)}")
    if not tasks:
        raise UserError("--task names no task")
    try:
        per_task = {t: parse_mixer_list(args.mixers or recall.DEFAULT_MIXERS[t]) for t in tasks}
        sizes = parse_int_list("--sizes", args.sizes)
    except SpecError as err:
        raise UserError(str(err)) from None
    for flag, v in (("--d-key", args.d_key), ("--steps", args.steps)):
        if v < 1:
            raise UserError(f"{flag} must be >= 1, got {v}")
    for t in tasks:
        valid = mixer_names() if t == "mqar" else MEMORIES
        for name, _ in per_task[t]:
            if name not in valid:
                raise UserError(f"unknown mixer {name!r} for task {t}; choose from {', '.join(valid)}")
        if t == "mqar" and any(s < 2 for s in sizes):
            raise UserError("mqar needs --sizes >= 2")
    # Build every model once before any training so bad options fail fast, as one line.
    for t in tasks:
        for name, opts in per_task[t]:
            try:
                if t == "mqar":
                    recall.run_mqar(sizes[0], name, opts, d_key=args.d_key, steps=0, seed=0)
                else:
                    recall.RetrievalModel(sizes[0], name, d_key=args.d_key, **opts)
            except (TypeError, ValueError) as err:
                raise UserError(f"mixer {recall.mixer_label(name, opts)}: {err}") from None
    out = Path(args.out)
    prepare_out(out, args.overwrite, ("results.csv", "results.png"))
    runs = [(t, n, o, s) for t in tasks for n, o in per_task[t] for s in sizes]
    results = []
    start = time.perf_counter()
    bar = tqdm(runs, desc="recall", unit="model", disable=args.quiet, file=sys.stderr)
    for task, name, opts, size in bar:
        label = recall.mixer_label(name, opts)
        bar.set_postfix_str(f"{task} {label} S={size}")

        def report(step: int, loss: float, _label=label, _task=task, _size=size) -> None:
            bar.set_postfix_str(f"{_task} {_label} S={_size} step {step} eval {loss:.3g}")

        if task == "mqar":
            r = recall.run_mqar(size, name, opts, d_key=args.d_key, steps=args.steps,
                                seed=args.seed, report=report)
        else:
            r = recall.run_retrieval(task, size, name, opts, d_key=args.d_key, steps=args.steps,
                                     seed=args.seed, report=report)
        results.append(r)
        recall.write_csv(results, out / "results.csv")  # partial results survive an interrupt
    bar.close()
    print(recall.format_table(results))
    print(f"total {time.perf_counter() - start:.0f} s; table in {out / 'results.csv'}")
    if recall.plot(results, out / "results.png", args.d_key):
        print(f"plot in {out / 'results.png'}")
    else:
        print("matplotlib is not installed: no plot written (pip install matplotlib)")
    return 0


def _load_corpus(spec: str):
    from ..tasks import load_corpus

    try:
        return load_corpus(spec)
    except (ValueError, OSError) as err:
        raise UserError(str(err)) from None


def _load_model(path: str):
    from .checkpoint import load_model

    try:
        return load_model(path)
    except ValueError as err:
        raise UserError(str(err)) from None


def _model_config(settings: dict[str, Any]):
    """The LMConfig of the run settings (``mixer`` as written on the command line); UserError for
    a bad mixer specification or config."""
    from ..models import LMConfig

    try:
        specs = parse_mixer_list(settings["mixer"])
    except SpecError as err:
        raise UserError(str(err)) from None
    names: str | list[str] = [n for n, _ in specs]
    options: dict[str, Any] | list[dict[str, Any]] = [o for _, o in specs]
    if len(specs) == 1:
        names, options = names[0], options[0]
    try:
        # LMConfig runs every layer's own option checks, before any output
        return LMConfig(vocab_size=256, mixer=names, mixer_options=options,
                        **{k: settings[k] for k in _MODEL_SETTINGS})
    except (TypeError, ValueError) as err:
        raise UserError(str(err).removeprefix("LMConfig.")) from None


# Command-line settings of `train` that are LMConfig fields of the same name (--mixer aside).
_MODEL_SETTINGS = ("d_model", "n_layers", "n_heads", "ffn", "glu_activation", "norm", "dropout",
                   "max_seq_len")


def _data_name(spec: str) -> str:
    """``--data`` as recorded in run.json: an existing path made absolute, so that resuming or
    evaluating from another working folder reads the same corpus; else as given."""
    return spec if spec == "stdlib" or not Path(spec).exists() else str(Path(spec).resolve())


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _resume_settings(given: dict[str, Any], record) -> dict[str, Any]:
    """The training settings of ``train --resume``: the record's (a ``RunRecord``), with the
    options ``given`` on the command line that may change on resume (``RESUMABLE``). Any other
    option given must agree with the record, else one UserError names every disagreement."""
    from .trainer import RESUMABLE, same_data

    differ = []
    for dest, value in given.items():
        if dest in RESUMABLE:
            continue
        if dest == "data":
            same, recorded = same_data(value, record.data), record.data
        elif dest == "mixer":
            try:
                mine = _model_config({**record.model.to_dict(), "mixer": value})
                same = (mine.layer_mixers(), mine.layer_options()) == (
                    record.model.layer_mixers(), record.model.layer_options())
            except UserError:
                same = False
            recorded = ",".join(":".join([n, *(f"{k}={v}" for k, v in o.items())]) for n, o in zip(
                record.model.layer_mixers(), record.model.layer_options()))
        elif dest in _MODEL_SETTINGS:
            recorded = getattr(record.model, dest)
            same = value == recorded
        else:
            recorded = getattr(record.train, dest)
            same = value == recorded
        if not same:
            differ.append(f"{_flag(dest)} {value} (the run has {recorded})")
    if differ:
        raise UserError(f"--resume: {'; '.join(differ)}: a resumed run keeps its own settings "
                        f"(only {', '.join(_flag(d) for d in RESUMABLE)} may change); leave the "
                        "option out, or train a new run with another --out")
    return {k: given[k] for k in RESUMABLE if k in given}


def cmd_train(args: argparse.Namespace) -> int:
    import dataclasses
    import os
    import signal

    from .checkpoint import CheckpointWriteError
    from .trainer import (
        RUN_FILE,
        TrainConfig,
        TrainingAnomaly,
        TrainingInterrupted,
        read_run,
        train,
    )

    out = Path(args.out)
    main = int(os.environ.get("RANK", "0")) == 0
    given = {k: getattr(args, k) for k in args.setting_defaults if getattr(args, k) is not None}
    if args.resume:
        if args.overwrite:
            raise UserError("--resume continues the run in --out and --overwrite replaces it: "
                            "give one of them")
        if not (out / RUN_FILE).is_file():  # a run killed before its first save restarts at step 0
            raise UserError(f"--resume: {out} holds no training run to resume (no {RUN_FILE})")
        try:
            record = read_run(out)
            tcfg = dataclasses.replace(record.train, **_resume_settings(given, record))
        except ValueError as err:
            raise UserError(str(err)) from None
        mcfg, data = None, record.data
    else:
        settings = {**args.setting_defaults, **given}
        try:
            tcfg = TrainConfig(**{f.name: settings[f.name] for f in dataclasses.fields(TrainConfig)
                                  if f.name in settings})
        except ValueError as err:
            raise UserError(str(err)) from None
        mcfg = _model_config(settings)
        data = settings["data"]
        if main:
            check_out(out, args.overwrite)  # the earlier run is replaced only by train() itself
            make_folder(out)
    corpus = _load_corpus(_data_name(data))
    try:
        losses = train(out, mcfg, tcfg, corpus, resume=args.resume, overwrite=args.overwrite,
                       progress=not args.quiet)
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


def _run_data(checkpoint: str) -> str:
    """The data of the training run a checkpoint belongs to (a run folder, or a
    ``checkpoints/step-N`` folder in one): what its run.json records; 'stdlib' outside a run."""
    from .trainer import RUN_FILE, read_run

    path = Path(checkpoint)
    for run in (path, path.parent.parent):
        if (run / RUN_FILE).is_file() and (run == path or path.parent.name == "checkpoints"):
            try:
                return read_run(run).data
            except ValueError as err:
                raise UserError(f"{err}; pass --data") from None
    return "stdlib"


def cmd_eval(args: argparse.Namespace) -> int:
    import json
    import math

    from .trainer import evaluate

    if args.seq_len < 1 or args.windows < 1:
        raise UserError("--seq-len and --windows must be >= 1")
    model = _load_model(args.checkpoint)
    limit = model.config.max_seq_len
    if limit is not None and (args.seq_len > limit or (args.carry_state and args.seq_len * args.windows > limit)):
        raise UserError(f"the model supports sequences of at most {limit} tokens (max_seq_len)")
    corpus = _load_corpus(args.data if args.data is not None else _run_data(args.checkpoint))
    try:
        loss = evaluate(model, corpus.val, args.seq_len, args.windows, carry_state=args.carry_state)
    except ValueError as err:
        raise UserError(str(err)) from None
    result = {"checkpoint": str(args.checkpoint), "data": corpus.name, "seq_len": args.seq_len,
              "windows": args.windows, "carry_state": args.carry_state, "loss": loss,
              "perplexity": math.exp(loss), "bits_per_byte": loss / math.log(2)}
    print(json.dumps(result))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from ..tasks import ByteTokenizer

    model = _load_model(args.checkpoint)
    tok = ByteTokenizer()
    ids = tok.encode(args.prompt)
    if ids.numel() == 0:
        raise UserError("--prompt must not be empty")
    if model.config.vocab_size != tok.vocab_size:
        raise UserError(f"the checkpoint's vocabulary ({model.config.vocab_size}) is not bytes (256)")
    try:
        out = model.generate(ids, args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, seed=args.seed)
    except ValueError as err:
        raise UserError(str(err)) from None
    print(tok.decode(out))
    return 0
