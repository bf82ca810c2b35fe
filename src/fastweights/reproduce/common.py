"""The reproductions' shared output contract: planned runs, per-run result files (written
atomically, so an interrupted reproduction continues from its finished runs), ``results.csv``,
``results.md`` with one verdict per claim, and the verdict rule itself.

No mathematics here: models come from ``LMConfig`` / the retrieval model, training from
``fastweights.train``; this module only schedules, stores and compares.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import re
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..train.checkpoint import write_atomic

MANIFEST = "reproduce.json"
RUNS = "runs"
RESULT_FILE = "result.json"
OUTPUTS = (MANIFEST, RUNS, "results.csv", "results.md")  # plus the experiment's PNG files
BASE_FIELDS = ("experiment", "model", "seed", "parameters", "steps", "tokens", "seconds")

# The verdict rule's constants (quoted in every results.md).
Z = 2.0             # differences must exceed Z standard errors of the difference ...
REL_FLOOR = 0.01    # ... and 1 % of the reference value (the only threshold with one seed)


class ReproduceError(ValueError):
    """A mistake in what the user asked for (unknown experiment, bad seeds, a foreign --out)."""


@dataclass(frozen=True)
class RunSpec:
    """One training run of an experiment: a model label (unique in the experiment), a seed and
    the experiment's own JSON-serialisable settings for it."""

    model: str
    seed: int
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def key(self) -> str:
        """File-system-safe folder name of the run."""
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", self.model).strip("_") + f"__seed{self.seed}"


@dataclass(frozen=True)
class Claim:
    """A paper's claim as a comparison of two measured quantities, each ``(model, metric)``,
    lower is better: ``kind="better"`` says ``a`` is lower than ``b``; ``kind="not_worse"`` says
    ``a`` is not higher than ``b`` (by more than the noise threshold)."""

    name: str
    paper: str
    a: tuple[str, str]
    b: tuple[str, str]
    kind: str = "better"

    def __post_init__(self) -> None:
        if self.kind not in ("better", "not_worse"):
            raise ValueError(f"Claim.kind must be 'better' or 'not_worse', got {self.kind!r}")


@dataclass
class Verdict:
    verdict: str     # "reproduced" | "not reproduced" | "inconclusive"
    mean_a: float
    spread_a: float
    mean_b: float
    spread_b: float
    threshold: float
    n_a: int
    n_b: int


def _finite_or_inf(values: Sequence[float]) -> list[float]:
    """NaN (a diverged run) counts as infinitely bad."""
    return [v if math.isfinite(v) else math.inf for v in values]


def mean_spread(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; nan with one value)."""
    vals = _finite_or_inf(values)
    if not vals:
        return math.nan, math.nan
    if any(math.isinf(v) for v in vals):
        return math.inf, math.nan
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else math.nan


def decide(a: Sequence[float], b: Sequence[float], kind: str) -> Verdict:
    """The verdict rule. d = mean(b) - mean(a) (> 0: a is lower, as claimed). The threshold is
    max(Z * sqrt(s_a^2/n_a + s_b^2/n_b), REL_FLOOR * |mean(b)|), the standard-error part only
    when both sides have >= 2 seeds. ``better``: reproduced if d > threshold, not reproduced if
    d < -threshold, else inconclusive. ``not_worse``: reproduced if d >= -threshold, else not
    reproduced. A diverged (NaN/inf) side is infinitely bad; both diverged is inconclusive."""
    if not a or not b:
        return Verdict("inconclusive", math.nan, math.nan, math.nan, math.nan, math.nan, len(a), len(b))
    ma, sa = mean_spread(a)
    mb, sb = mean_spread(b)
    if math.isinf(ma) and math.isinf(mb):
        return Verdict("inconclusive", ma, sa, mb, sb, math.nan, len(a), len(b))
    if math.isinf(ma) or math.isinf(mb):
        threshold = math.nan
        d = math.inf if math.isinf(mb) else -math.inf
    else:
        se = math.sqrt(sa ** 2 / len(a) + sb ** 2 / len(b)) if len(a) > 1 and len(b) > 1 else 0.0
        threshold = max(Z * se, REL_FLOOR * abs(mb))
        d = mb - ma
        if not math.isfinite(threshold):
            threshold = REL_FLOOR * abs(mb)
    thr = 0.0 if math.isnan(threshold) else threshold
    if kind == "better":
        v = "reproduced" if d > thr else "not reproduced" if d < -thr else "inconclusive"
    else:
        v = "reproduced" if d >= -thr else "not reproduced"
    return Verdict(v, ma, sa, mb, sb, threshold, len(a), len(b))


RULE_TEXT = (
    f"Verdict rule (lower is better for every quantity): d = mean(B) - mean(A) over seeds; "
    f"threshold = max({Z:g} x the standard error of d (only with >= 2 seeds on both sides), "
    f"{REL_FLOOR:.0%} of |mean(B)|). \"A < B\": reproduced if d > threshold, not reproduced if "
    f"d < -threshold, otherwise inconclusive at this scale. \"A <= B\" (not worse): reproduced "
    f"if d >= -threshold, else not reproduced. A diverged run (NaN) counts as infinitely bad. "
    f"With one seed the spread is unknown and only the {REL_FLOOR:.0%} floor applies: treat such "
    f"verdicts as provisional.")


def fmt(mean: float, spread: float) -> str:
    """``1.234 ± 0.005`` (no spread with one seed)."""
    if not math.isfinite(mean):
        return "diverged" if math.isinf(mean) else "n/a"
    text = f"{mean:.4g}"
    return text if not math.isfinite(spread) else f"{text} ± {spread:.2g}"


# ---------------------------------------------------------------------------- the run store


def _settings_id(experiment: str, size: str, settings: dict[str, Any]) -> dict[str, Any]:
    return {"experiment": experiment, "size": size, "settings": settings}


def prepare_out(out: Path, manifest: dict[str, Any], overwrite: bool) -> bool:
    """Create ``out`` for this experiment. A folder holding the same experiment with the same
    settings is continued (returns True: resume); any other non-empty folder is refused unless
    ``overwrite``, which then deletes only the reproduction's own outputs."""
    if out.exists() and not out.is_dir():
        raise ReproduceError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        saved = None
        with contextlib.suppress(OSError, ValueError):
            saved = json.loads((out / MANIFEST).read_text())
        if not overwrite:
            if saved == manifest:
                return True
            what = (f"a different reproduction ({saved.get('experiment')}, {saved.get('size')} "
                    "size or other settings)" if isinstance(saved, dict) else "other files")
            raise ReproduceError(f"--out {out} already holds {what}; pass --overwrite or choose "
                                 "another folder")
        for name in OUTPUTS:
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        for png in out.glob("*.png"):
            png.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ReproduceError(f"--out {out}: cannot create this folder ({err.strerror or err})") from None
    write_atomic(out / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return False


def load_result(out: Path, spec: RunSpec) -> dict[str, Any] | None:
    """The finished run's result, or None (not run, or cut short before its result was written)."""
    try:
        result = json.loads((out / RUNS / spec.key / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and "metrics" in result else None


def save_result(out: Path, spec: RunSpec, result: dict[str, Any]) -> None:
    path = out / RUNS / spec.key / RESULT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(result, indent=2) + "\n").encode())


# ------------------------------------------------------------------------------- the tables


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """One row per run: the base fields, then every metric that any run reported."""
    metrics = list(dict.fromkeys(k for r in rows for k in r["metrics"]))
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=[*BASE_FIELDS, *metrics])
    w.writeheader()
    for r in rows:
        w.writerow({**{k: r[k] for k in BASE_FIELDS}, "seconds": f"{r['seconds']:.1f}",
                    **{k: f"{v:.6g}" for k, v in r["metrics"].items()}})
    write_atomic(path, text.getvalue().encode())


def values(rows: list[dict[str, Any]], model: str, metric: str) -> list[float]:
    """The metric of every seed of ``model``."""
    out = []
    for r in rows:
        if r["model"] == model and metric in r["metrics"]:
            v = r["metrics"][metric]
            out.append(math.nan if v is None else float(v))
    return out


def judge(rows: list[dict[str, Any]], claims: list[Claim]) -> list[tuple[Claim, Verdict]]:
    return [(c, decide(values(rows, *c.a), values(rows, *c.b), c.kind)) for c in claims]


def claims_table(judged: list[tuple[Claim, Verdict]]) -> str:
    lines = ["| claim | paper | ours: A vs B (mean ± sd over seeds) | verdict |",
             "|---|---|---|---|"]
    for c, v in judged:
        rel = "<" if c.kind == "better" else "<="
        ours = (f"A = {c.a[0]} [{c.a[1]}] {fmt(v.mean_a, v.spread_a)} {rel} "
                f"B = {c.b[0]} [{c.b[1]}] {fmt(v.mean_b, v.spread_b)} (n = {v.n_a}, {v.n_b}; "
                f"threshold {v.threshold:.2g})")
        lines.append(f"| {c.name} | {c.paper} | {ours} | **{v.verdict}** |")
    return "\n".join(lines)


def models_table(rows: list[dict[str, Any]], metrics: Sequence[str]) -> str:
    """Per model: parameters, steps, tokens, mean ± sd of ``metrics`` and of the wall time."""
    head = ["model", "parameters", "steps", "tokens", *metrics, "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        cells = [model, str(mine[0]["parameters"]), str(mine[0]["steps"]), str(mine[0]["tokens"])]
        cells += [fmt(*mean_spread(values(rows, model, m))) for m in metrics]
        cells.append(fmt(*mean_spread([r["seconds"] for r in mine])))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_markdown(path: Path, *, title: str, intro: str, settings: dict[str, Any],
                   judged: list[tuple[Claim, Verdict]], rows: list[dict[str, Any]],
                   metrics: Sequence[str], notes: Sequence[str], plots: Sequence[str],
                   seeds: Sequence[int], seconds: float) -> None:
    parts = [f"# {title}", "", intro, "",
             (f"Seeds: {', '.join(map(str, seeds))}. Wall time of this invocation: {seconds:.0f} s "
             f"(runs finished earlier and reused are not included; see results.csv for each run's "
             f"own time)."), "",
             "Settings: " + ", ".join(f"{k} = {v}" for k, v in settings.items()), "",
             "## Claims", "", claims_table(judged), "", RULE_TEXT, "",
             "## Runs (mean ± sd over seeds)", "", models_table(rows, metrics), ""]
    if notes:
        parts += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    parts += ["## Plots", "", *([f"![{p}]({p})" for p in plots] or
                                ["matplotlib is not installed: no plot written (pip install matplotlib)"]), ""]
    write_atomic(path, "\n".join(parts).encode())


def matplotlib_pyplot() -> Any | None:
    """``matplotlib.pyplot`` with the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def bar_plot(path: Path, rows: list[dict[str, Any]], metric: str, ylabel: str, title: str) -> bool:
    """Mean ± sd of ``metric`` per model as bars; False without matplotlib."""
    plt = matplotlib_pyplot()
    if plt is None:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    stats = [mean_spread(values(rows, m, metric)) for m in models]
    means = [s[0] if math.isfinite(s[0]) else math.nan for s in stats]
    errs = [s[1] if math.isfinite(s[1]) else 0.0 for s in stats]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.7 * len(models) + 2), 4))
    ax.bar(range(len(models)), means, yerr=errs, capsize=3, color="tab:blue")
    ax.set_xticks(range(len(models)), models, rotation=35, ha="right", fontsize=8)
    finite = [m for m in means if math.isfinite(m)]
    if finite:
        lo, hi = min(finite), max(finite)
        ax.set_ylim(lo - 0.15 * (hi - lo + 1e-9) - 0.01, hi + 0.15 * (hi - lo + 1e-9) + 0.01)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------ the runner


@dataclass
class Plan:
    """What one experiment will run: its settings (recorded in the manifest, so a resumed
    reproduction must have the same) and the runs, in order."""

    settings: dict[str, Any]
    runs: list[RunSpec]


def run_all(out: Path, experiment: str, plan: Plan, execute: Callable[[RunSpec, Path], dict[str, Any]],
            *, progress: bool) -> tuple[list[dict[str, Any]], int]:
    """Run every planned run not finished yet (its result file absent) and return all results in
    plan order, and how many were reused. ``execute(spec, workdir)`` returns the run's
    ``parameters, steps, tokens, metrics`` (and optional ``extra``); its wall time is added."""
    from tqdm import tqdm

    results, reused = [], 0
    bar = tqdm(plan.runs, desc=experiment, unit="run", disable=not progress)
    for spec in bar:
        bar.set_postfix_str(f"{spec.model} seed {spec.seed}")
        result = load_result(out, spec)
        if result is None:
            start = time.perf_counter()
            body = execute(spec, out / RUNS / spec.key)
            result = {"experiment": experiment, "model": spec.model, "seed": spec.seed,
                      "seconds": time.perf_counter() - start, **body}
            save_result(out, spec, result)
        else:
            reused += 1
        results.append(result)
    bar.close()
    return results, reused


@dataclass
class Experiment:
    """One reproduction: ``plan(quick, seeds, data)`` -> Plan (runs carry their full model
    settings in ``options``); ``execute(spec, plan, workdir)`` -> the run's ``parameters, steps,
    tokens, metrics``; ``claims(plan)``; ``metrics(plan)`` the columns of the per-model table;
    ``plots(rows, out, plan)`` -> the PNG file names written (none without matplotlib);
    ``notes(plan, rows)`` -> lines for results.md (deviations from the paper, ...)."""

    name: str
    title: str
    intro: str
    plan: Callable[[bool, list[int], str], Plan]
    execute: Callable[[RunSpec, Plan, Path], dict[str, Any]]
    claims: Callable[[Plan], list[Claim]]
    metrics: Callable[[Plan], list[str]]
    plots: Callable[[list[dict[str, Any]], Path, Plan], list[str]]
    notes: Callable[[Plan, list[dict[str, Any]]], list[str]]
