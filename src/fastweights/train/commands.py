"""Implementations of the ``fastweights`` subcommands (cli.py holds only their arguments).

Every user mistake raises ``UserError`` (one stderr line, exit 2)."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from ..cli import UserError
from .specs import SpecError, parse_int_list, parse_mixer_list


def prepare_out(out: Path, overwrite: bool) -> None:
    """Create ``out``; an existing non-empty folder is refused unless ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"--out {out} already holds results of an earlier run; "
                            "pass --overwrite or choose another folder")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def cmd_recall(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..models.registry import mixer_names
    from ..models.retrieval import MEMORIES
    from . import recall

    try:
        tasks = [t.strip() for t in args.task.split(",") if t.strip()]
        mixers = parse_mixer_list(args.mixers)
        sizes = parse_int_list("--sizes", args.sizes)
    except SpecError as err:
        raise UserError(str(err)) from None
    for t in tasks:
        if t not in recall.TASKS:
            raise UserError(f"unknown --task {t!r}; choose from {', '.join(recall.TASKS)}")
    if not tasks:
        raise UserError("--task names no task")
    for flag, v in (("--d-key", args.d_key), ("--steps", args.steps)):
        if v < 1:
            raise UserError(f"{flag} must be >= 1, got {v}")
    for t in tasks:
        valid = mixer_names() if t == "mqar" else MEMORIES
        for name, _ in mixers:
            if name not in valid:
                raise UserError(f"unknown mixer {name!r} for task {t}; choose from {', '.join(valid)}")
        if t == "mqar" and any(s < 2 for s in sizes):
            raise UserError("mqar needs --sizes >= 2")
    # Build every model once before any training so bad options fail fast, as one line.
    for t in tasks:
        for name, opts in mixers:
            try:
                if t == "mqar":
                    recall.run_mqar(sizes[0], name, opts, d_key=args.d_key, steps=0, seed=0)
                else:
                    recall.RetrievalModel(sizes[0], name, d_key=args.d_key, **opts)
            except (TypeError, ValueError) as err:
                raise UserError(f"mixer {recall.mixer_label(name, opts)}: {err}") from None
    out = Path(args.out)
    prepare_out(out, args.overwrite)
    runs = [(t, n, o, s) for t in tasks for n, o in mixers for s in sizes]
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
