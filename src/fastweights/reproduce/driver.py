"""The driver of the reproductions: look an experiment up by name, run (or continue) it, write
its results. Raises ``ReproduceError`` (a ValueError) for every user mistake."""

from __future__ import annotations

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


def experiment(name: str) -> Experiment:
    """The experiment registered as ``name`` (``EXPERIMENTS``)."""
    if name not in EXPERIMENTS:
        raise ReproduceError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]


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
