"""Implementations of the ``fastweights`` subcommands (cli.py holds only their arguments).

Every user mistake raises ``UserError`` (one stderr line, exit 2)."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from ..cli import UserError, make_folder
from .specs import SpecError, parse_int_list, parse_mixer_list


def prepare_out(out: Path, overwrite: bool, outputs: tuple[str, ...]) -> None:
    """Create ``out``; an existing non-empty folder is refused unless ``overwrite``, which then
    deletes only ``outputs`` (the files and folders the command writes), never anything else a
    mistyped ``--out`` might hold."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"--out {out} already holds results of an earlier run; "
                            "pass --overwrite or choose another folder")
        for name in outputs:
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


def cmd_train(args: argparse.Namespace) -> int:
    import os

    from ..models import LMConfig
    from .checkpoint import CheckpointWriteError
    from .trainer import METRICS_FILE, RUN_FILE, TrainConfig, TrainingAnomaly, train

    out = Path(args.out)
    try:
        tcfg = TrainConfig(
            steps=args.steps if args.steps is not None else TrainConfig.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
            warmup=args.warmup, eval_every=args.eval_every, eval_windows=args.eval_windows,
            anomaly_guard=args.anomaly_guard,
            save_every=args.save_every, patience=args.patience, bf16=args.bf16, seed=args.seed,
            pack=args.pack, recompute=args.recompute)
    except ValueError as err:
        raise UserError(str(err)) from None
    mcfg = None
    if args.resume:
        if not (out / RUN_FILE).is_file():  # a run killed before its first save restarts at step 0
            raise UserError(f"--resume: {out} holds no training run to resume (no {RUN_FILE})")
    else:
        try:
            specs = parse_mixer_list(args.mixer)
        except SpecError as err:
            raise UserError(str(err)) from None
        names = [n for n, _ in specs]
        options = [o for _, o in specs]
        if len(specs) == 1:
            names, options = names[0], options[0]
        try:
            mcfg = LMConfig(vocab_size=256, d_model=args.d_model, n_layers=args.n_layers,
                            n_heads=args.n_heads, mixer=names, mixer_options=options, ffn=args.ffn,
                            glu_activation=args.glu_activation, norm=args.norm,
                            dropout=args.dropout, max_seq_len=args.max_seq_len)
            # LMConfig runs every layer's own option checks, before any output
        except (TypeError, ValueError) as err:
            raise UserError(str(err).removeprefix("LMConfig.")) from None
        if int(os.environ.get("RANK", "0")) == 0:
            prepare_out(out, args.overwrite, (RUN_FILE, METRICS_FILE, "checkpoints", "tensorboard"))
    corpus = _load_corpus(args.data)
    try:
        losses = train(out, mcfg, tcfg if not args.resume or args.steps is not None else None, corpus,
                       resume=args.resume, progress=not args.quiet)
    except (ValueError, TrainingAnomaly, CheckpointWriteError) as err:
        raise UserError(str(err)) from None
    if losses and int(os.environ.get("RANK", "0")) == 0:
        print(f"trained to step {losses[-1][0]}: last train loss {losses[-1][1]:.4f}; "
              f"metrics in {out / 'metrics.csv'}, checkpoint in {out / 'checkpoints'}")
    return 0


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
    corpus = _load_corpus(args.data)
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
