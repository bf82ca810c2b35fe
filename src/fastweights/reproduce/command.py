"""The ``reproduce`` subcommand's arguments and driver. Raises ``ReproduceError`` (a ValueError)
for every user mistake; the CLI turns it into one line and exit code 2."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from . import EXPERIMENTS
from .common import (
    Experiment,
    ReproduceError,
    judge,
    prepare_out,
    run_all,
    write_csv,
    write_markdown,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help=f"the experiment: {', '.join(EXPERIMENTS)}")
    p.add_argument("--seeds", default=None,
                   help="comma-separated seeds, e.g. 0,1,2 (default: 0,1; --quick: 0)")
    p.add_argument("--quick", action="store_true",
                   help="CI-sized version: every run of the experiment in seconds")
    p.add_argument("--data", default="stdlib",
                   help="byte corpus of the language-model experiments: 'stdlib' or a text file "
                        "or folder (default: stdlib)")
    p.add_argument("--out", default=None, help="output folder (default runs/reproduce/NAME)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier reproduction's --out (the same command continues it)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> [0, 1, 2]: distinct non-negative ints."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ReproduceError(f"--seeds must be comma-separated non-negative integers, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ReproduceError(f"--seeds must be distinct non-negative integers, got {text!r}")
    return seeds


def experiment(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise ReproduceError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f".{EXPERIMENTS[name]}", __package__).EXPERIMENT


def reproduce(name: str, out: Path, seeds: list[int], *, quick: bool = False, data: str = "stdlib",
              overwrite: bool = False, progress: bool = True) -> Path:
    """Run (or continue) experiment ``name`` into ``out``; returns the path of results.md."""
    exp = experiment(name)
    plan = exp.plan(quick, seeds, data)
    manifest = {"experiment": name, "size": "quick" if quick else "default",
                "settings": plan.settings,
                "models": {r.model: r.options for r in plan.runs if r.seed == seeds[0]}}
    resumed = prepare_out(out, manifest, overwrite)
    start = time.perf_counter()
    rows, reused = run_all(out, name, plan, lambda spec, wd: exp.execute(spec, plan, wd),
                           progress=progress)
    write_csv(out / "results.csv", rows)
    judged = judge(rows, exp.claims(plan))
    write_markdown(out / "results.md", title=exp.title, intro=exp.intro,
                   settings={k: v for k, v in plan.settings.items()},
                   judged=judged, rows=rows, metrics=exp.metrics(plan),
                   notes=exp.notes(plan, rows), plots=exp.plots(rows, out, plan), seeds=seeds,
                   seconds=time.perf_counter() - start)
    if resumed and progress:
        print(f"continued {out}: {reused} finished run(s) reused", file=sys.stderr)
    return out / "results.md"


def run(args: argparse.Namespace) -> int:
    exp = experiment(args.name)
    seeds = parse_seeds(args.seeds) if args.seeds is not None else ([0] if args.quick else [0, 1])
    out = Path(args.out) if args.out else Path("runs") / "reproduce" / exp.name
    md = reproduce(exp.name, out, seeds, quick=args.quick, data=args.data,
                   overwrite=args.overwrite, progress=not args.quiet)
    text = md.read_text()
    claims = text[text.index("## Claims"):text.index("## Runs")].strip()
    print(claims.split("\n\nVerdict rule")[0])
    print(f"\nresults in {md.parent} (results.md, results.csv, plots)")
    return 0
