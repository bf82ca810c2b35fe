"""The driver of the reproductions: look an experiment up by name, run (or continue) it, write
its results. Raises ``ReproduceError`` (a ValueError) for every user mistake."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..train.checkpoint import write_atomic
from . import EXPERIMENTS
from .common import (
    MANIFEST,
    WINDOWS,
    Experiment,
    Plan,
    ReproduceError,
    finished_results,
    judge,
    prepare_out,
    read_csv,
    read_windows,
    run_all,
    write_csv,
    write_markdown,
    write_windows,
)
from .prose import readme_of


def experiment(name: str) -> Experiment:
    """The experiment registered as ``name`` (``EXPERIMENTS``)."""
    if name not in EXPERIMENTS:
        raise ReproduceError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]


def reproduce(name: str, out: Path, seeds: list[int], *, quick: bool = False, data: str = "stdlib",
              overwrite: bool = False, progress: bool = True,
              models: Sequence[str] | None = None, steps_factor: int = 1) -> Path:
    """Run (or continue) experiment ``name`` into ``out``; returns the path of results.md.
    ``models``: run only these models' runs of ``seeds`` (more seeds for the models of a claim
    whose effect is near its margin); results.csv then holds every finished run in ``out``.
    ``steps_factor`` K: every run trains K times the experiment's steps (the settings record
    ``steps`` and ``steps_factor``; docs/reproductions.md, "One step past toy scale")."""
    exp = experiment(name)
    plan = exp.plan(quick, seeds, data)
    if not (isinstance(steps_factor, int) and steps_factor >= 1):
        raise ReproduceError(f"--steps-factor must be an int >= 1, got {steps_factor!r}")
    if steps_factor > 1:
        if "steps" not in plan.settings:
            raise ReproduceError(f"experiment {name} has no steps setting to multiply "
                                 "(--steps-factor)")
        plan.settings["steps"] *= steps_factor
        plan.settings["steps_factor"] = steps_factor
    manifest = {"experiment": name, "size": "quick" if quick else "default",
                "settings": plan.settings,
                "models": {r.model: r.options for r in plan.runs if r.seed == seeds[0]}}
    order = list(manifest["models"])
    if models is not None:
        unknown = sorted(set(models) - set(order))
        if unknown:
            raise ReproduceError(f"experiment {name} has no model {unknown[0]!r}; its models: "
                                 f"{', '.join(order)}")
        plan = Plan(plan.settings, [r for r in plan.runs if r.model in models])
    resumed = prepare_out(out, manifest, overwrite)
    start = time.perf_counter()
    rows, reused = run_all(out, name, plan, lambda spec, wd: exp.execute(spec, plan, wd),
                           progress=progress)
    if models is not None:  # every finished run of the folder, in plan order
        done = {(r["model"], r["seed"]) for r in rows}
        rows += [r for r in finished_results(out) if (r["model"], r["seed"]) not in done]
        rows.sort(key=lambda r: (r["seed"], order.index(r["model"]) if r["model"] in order else len(order)))
    write_csv(out / "results.csv", rows)
    write_windows(out / WINDOWS, rows)
    rows = read_csv(out / "results.csv")  # the verdicts from the numbers as recorded, as --render
    _write_results(exp, plan, rows, out, sorted({r["seed"] for r in rows}),
                   time.perf_counter() - start)
    if resumed and progress:
        print(f"continued {out}: {reused} finished run(s) reused", file=sys.stderr)
    return out / "results.md"


def _write_results(exp: Experiment, plan: Plan, rows: list[dict], out: Path, seeds: list[int],
                   seconds: float | None, origin: Path | None = None) -> None:
    """results.md (the verdicts with the runs' per-window losses of ``windows.csv`` where
    recorded); ``seconds`` None (a re-render) keeps the recorded plots as they are (some are
    drawn from the run folders, which a record need not keep)."""
    plots = (exp.plots(rows, out, plan) if seconds is not None else
             sorted(p.name for p in out.glob("*.png")))
    windows = read_windows(out / WINDOWS)
    judged = judge(rows, exp.claims(plan), untrained=exp.untrained, windows=windows)
    write_markdown(out / "results.md", title=exp.title, intro=exp.intro,
                   settings=dict(plan.settings), judged=judged, rows=rows,
                   metrics=exp.metrics(plan), notes=[*exp.notes(plan, rows), *_noise_note(plan, rows, windows)],
                   plots=plots, seeds=seeds, seconds=seconds)
    readme = readme_of(out, rows, judged, _base(exp, plan, origin or out))
    if readme is not None:
        write_atomic(out / "README.md", readme.encode())


def _noise_note(plan: Plan, rows: list[dict], windows: dict | None) -> list[str]:
    """The results.md line on the evaluation windows' noise of an LM experiment (one scored on
    a fixed set of validation windows or streams): which runs kept their per-window losses."""
    if not {"eval_windows", "streams"} & set(plan.settings):
        return []
    kept = {k[:2] for k in windows or {}}
    missing = [r for r in rows if (r["model"], r["seed"]) not in kept]
    if not missing:
        return ["Evaluation noise: every run kept its per-window losses (windows.csv); each "
                "interval adds the windows' standard error to the seeds' (`common.window_se`)."]
    return [f"Evaluation noise: {len(missing)} of {len(rows)} runs did not keep their per-window "
            "losses (runs recorded before issue 44: the run folders were not kept, and "
            "recomputing them means retraining), so the intervals of the claims on them are the "
            "seeds' alone and treat the evaluation windows as fixed; a claim whose runs all kept "
            "them (windows.csv) adds the windows' standard error (`common.window_se`)."]


def _base(exp: Experiment, plan: Plan, origin: Path) -> tuple[list[dict], list] | None:
    """The (rows, judged) of the record a record trained at K > 1 times the steps was grown
    from: its experiment's default-size record, the folder named after the experiment beside
    ``origin`` (benchmarks/results/reproduce/fwp-lm for fwp-lm-4x); None for a default-size
    record or where that folder holds no record."""
    import json

    folder = origin.parent / exp.name
    if plan.settings.get("steps_factor", 1) == 1 or not (folder / MANIFEST).is_file():
        return None
    base = Plan(json.loads((folder / MANIFEST).read_text())["settings"], [])
    rows = read_csv(folder / "results.csv")
    return rows, judge(rows, exp.claims(base), untrained=exp.untrained,
                       windows=read_windows(folder / WINDOWS))


def render(out: Path, name: str | None = None, origin: Path | None = None) -> Path:
    """Rewrite ``out``'s results.md (and README.md from its README.in.md, ``prose``) from its
    recorded ``reproduce.json``, ``results.csv`` and ``windows.csv`` with the current claims and
    verdict rule, training nothing. ``name``: the experiment whose claims to apply (default: the
    one the manifest names); ``origin``: where the record lies when ``out`` is a copy of it (its
    base record, ``_base``, is found beside it). Returns results.md."""
    import json

    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        raise ReproduceError(f"--out {out} holds no reproduction ({MANIFEST} missing or unreadable)") from None
    exp = experiment(name or manifest.get("experiment", ""))
    rows = read_csv(out / "results.csv")
    if not rows:
        raise ReproduceError(f"{out / 'results.csv'} has no runs")
    plan = Plan(manifest["settings"], [])
    seeds = sorted({r["seed"] for r in rows})
    _write_results(exp, plan, rows, out, seeds, None, origin)
    return out / "results.md"


RENDERED = ("results.md", "README.md")  # what ``render`` writes (README.md only from README.in.md)


def check(record: Path, name: str | None = None) -> list[str]:
    """The files of ``record`` that differ from what ``render`` makes of its recorded results
    (rendered in a scratch copy; the record is not touched): [] when its results.md and README.md
    are exactly their rendering, so that no figure in them can be edited by hand."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / record.name
        copy.mkdir()
        for f in record.iterdir():
            if f.is_file() and f.name not in RENDERED:
                shutil.copy2(f, copy / f.name)
        render(copy, name, origin=record)
        return [f for f in RENDERED if (copy / f).is_file() != (record / f).is_file() or
                ((copy / f).is_file() and (copy / f).read_bytes() != (record / f).read_bytes())]
