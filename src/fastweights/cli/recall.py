"""``fastweights recall``: memory capacity and update experiments on synthetic retrieval."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .._commands import UserError, parse_int_list, parse_mixer_list, positive_int, prepare_out

NAME = "recall"
DESCRIPTION = (
    "Train one model per (task, mixer, size) on the fast weight paper's synthetic retrieval "
    "(capacity = setting 1, update = setting 2) or on MQAR, and write results.csv and results.png "
    "(final eval loss vs size). The defaults show the paper's headline in a few minutes on a "
    "laptop CPU: sum-rule linear attention fails once the number of keys exceeds its feature size "
    "d_key, DPFP doubles that, and only the delta rule keeps the latest value when keys are "
    "re-assigned.")
OUTPUTS = ("results.csv", "results.png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="capacity,update",
                   help="comma-separated: capacity, update (retrieval model) and/or mqar (small LM)")
    p.add_argument("--mixers", default=None,
                   help="comma-separated; capacity/update: linear, dpfp, favor, delta, softmax; mqar: "
                   "registered mixer names; options as name:opt=value, e.g. dpfp:nu=2, favor:m=128, "
                   "delta:feature_map=dpfp (default per task: capacity linear,dpfp; update "
                   "linear,delta; mqar softmax,linear,delta)")
    p.add_argument("--sizes", default="8,16,32", help="numbers of keys S (mqar: key-value pairs)")
    p.add_argument("--d-key", type=positive_int, default=16,
                   help="key size of the memory (mqar: d_model)")
    p.add_argument("--steps", type=positive_int, default=1500,
                   help="maximum training steps per model")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="runs/recall", help="output folder")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run's --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _runs(args: argparse.Namespace) -> list[tuple[str, str, dict, int]]:
    """The (task, mixer, options, size) of every model to train, each model built once so that
    a bad option fails fast, as one line, before any training."""
    from ..models.registry import mixer_names
    from ..models.retrieval import MEMORIES
    from ..reproduce import recall

    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    for t in tasks:
        if t not in recall.TASKS:
            raise UserError(f"unknown --task {t!r}; choose from {', '.join(recall.TASKS)}")
    if not tasks:
        raise UserError("--task names no task")
    per_task = {t: parse_mixer_list("--mixers", args.mixers or recall.DEFAULT_MIXERS[t])
                for t in tasks}
    sizes = parse_int_list("--sizes", args.sizes)
    for t in tasks:
        valid = mixer_names() if t == "mqar" else MEMORIES
        for name, _ in per_task[t]:
            if name not in valid:
                raise UserError(f"unknown mixer {name!r} for task {t}; choose from {', '.join(valid)}")
        if t == "mqar" and any(s < 2 for s in sizes):
            raise UserError("mqar needs --sizes >= 2")
    for t in tasks:
        for name, opts in per_task[t]:
            try:
                if t == "mqar":
                    recall.run_mqar(sizes[0], name, opts, d_key=args.d_key, steps=0, seed=0)
                else:
                    recall.RetrievalModel(sizes[0], name, d_key=args.d_key, **opts)
            except (TypeError, ValueError) as err:
                raise UserError(f"mixer {recall.mixer_label(name, opts)}: {err}") from None
    return [(t, n, o, s) for t in tasks for n, o in per_task[t] for s in sizes]


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..reproduce import recall

    runs = _runs(args)
    out = Path(args.out)
    prepare_out(out, args.overwrite, OUTPUTS)
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
