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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..train.checkpoint import write_atomic

MANIFEST = "reproduce.json"
RUNS = "runs"
RESULT_FILE = "result.json"
WINDOWS = "windows.csv"  # the runs' per-window evaluation losses, where an experiment records them
OUTPUTS = (MANIFEST, RUNS, "results.csv", "results.md", WINDOWS)  # plus the experiment's PNG files
BASE_FIELDS = ("experiment", "model", "seed", "parameters", "steps", "tokens", "seconds")

# The verdict rule's constants (quoted in every results.md).
CONFIDENCE = 0.95   # noise = the half-width of the two-sided Student-t interval of the difference
REL_MARGIN = 0.01   # the smallest difference that counts: 1 % of |mean(B)|
MIN_SEEDS = 4       # fewer seeds (pairs) than this: no verdict
NEAR_SEEDS = 6      # an effect within NEAR_FACTOR x the margin needs this many seeds
NEAR_FACTOR = 2.0

KINDS = {
    # kind: (the relation written in the table, what the paper says)
    "better": ("<", "A is lower (better) than B"),
    "degrades": (">", "A is higher (worse) than B: the quantity degrades from B to A"),
    "not_worse": ("<=", "A is no higher than B (matches or beats it)"),
    "flat": ("~", "A and B are equal within the margin (an equality: they match)"),
}
# The labels (docs/reproductions.md, "The verdict rule"); for a directional claim the interval of
# the effect in the claimed direction decides: above 0 and the estimate at least the margin,
# REPRODUCED; entirely on the wrong side of 0, NOT_REPRODUCED (whatever its size); above 0 and
# below the margin, SMALLER; around 0 and inside +-margin, NO_EFFECT; anything else INCONCLUSIVE.
REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced"
SMALLER = "right direction, smaller than claimed"
NO_EFFECT = "no effect"
INCONCLUSIVE = "inconclusive"
NOT_MEASURED = "not measured"
VERDICTS = (REPRODUCED, NOT_REPRODUCED, SMALLER, NO_EFFECT, INCONCLUSIVE, NOT_MEASURED)


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
    """A paper's claim as a comparison of two measured quantities ``a`` and ``b``, each
    ``(model, metric)``, lower is better for every metric.

    ``paper`` locates and paraphrases the claim (section or table, and what it says); ``kind``
    is its direction (``KINDS``): ``better`` (A < B), ``degrades`` (A > B), ``not_worse``
    (A <= B within the margin) or ``flat`` (A ~ B within the margin). ``paired``: the two sides'
    runs of one seed share their data order (or are the same run), so the rule compares per-seed
    differences. ``floor``: a side whose mean is at or above it has not learned (chance level,
    0 % accuracy); ``ceiling``: a side whose mean is at or below it is perfect (100 %); both sides
    at the floor, or both at the ceiling, is *not measured*. ``control``: a check of the
    experiment itself (that a model trained, that a baseline fails where it must), not a claim
    of the paper; reported in its own table. ``margin``: the smallest difference that counts, as
    a fraction of |mean(B)| (a claim of a collapse asks for more than the default 1 %);
    ``margin_abs`` replaces it by an absolute difference (accuracies: a share of 0 % has no 1 %).
    ``unmeasured``: why the recorded quantities cannot test the claim (a timing taken on a shared
    machine, the whole model's gradient for the attention's): the verdict is *not measured*, the
    numbers are still shown. ``source``: where the claim comes from, the seed note of the paper
    (the papers' seed notes, by file and section or table) or docs/maths.md's recollection marked
    "[unverified]"; every claim that is not a control names one."""

    name: str
    paper: str
    a: tuple[str, str]
    b: tuple[str, str]
    kind: str = "better"
    paired: bool = True
    floor: float | None = None
    ceiling: float | None = None
    control: bool = False
    margin: float = REL_MARGIN
    margin_abs: float | None = None
    unmeasured: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if self.margin_abs is not None and not (isinstance(self.margin_abs, (int, float))
                                                and self.margin_abs >= 0):
            raise ValueError(f"Claim.margin_abs must be None or a number >= 0, got {self.margin_abs!r}")
        if not (isinstance(self.margin, (int, float)) and 0 <= self.margin < 1):
            raise ValueError(f"Claim.margin must be a fraction in [0, 1), got {self.margin!r}")
        if self.kind not in KINDS:
            raise ValueError(f"Claim.kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.floor is not None and self.ceiling is not None and self.ceiling >= self.floor:
            raise ValueError(f"Claim.ceiling ({self.ceiling}) must be below Claim.floor ({self.floor})")
        if not self.control and not self.source.strip():
            raise ValueError(f"Claim {self.name!r} must name its source (a seed note and its "
                             "section, or docs/maths.md marked [unverified])")


@dataclass
class Verdict:
    verdict: str     # one of VERDICTS
    mean_a: float
    spread_a: float
    mean_b: float
    spread_b: float
    d: float         # mean(B) - mean(A) (> 0: A is lower); the mean per-seed difference if paired
    noise: float     # the t interval's half-width (CONFIDENCE; nan with one seed per side)
    margin: float    # the claim's margin (default REL_MARGIN) x |mean(B)|
    n_a: int
    n_b: int
    paired: bool = False
    diffs: dict[int, float] = field(default_factory=dict)  # per seed B - A, when paired
    reason: str = ""  # why not measured, or what the verdict rests on
    se: float = math.nan       # the standard error of d (seeds, and evaluation windows if given)
    dof: int = 0               # its degrees of freedom (0: unknown)
    eval_se: float = math.nan  # the evaluation windows' share of se (nan: not recorded)
    p: float = math.nan        # two-sided p-value of d = 0 (Student t), before any adjustment
    p_holm: float = math.nan   # p Holm-adjusted over the record's claims (``judge``)

    @property
    def interval(self) -> tuple[float, float]:
        """The two-sided CONFIDENCE interval of d, (d - noise, d + noise) (nan: unknown)."""
        return self.d - self.noise, self.d + self.noise


def p_value(d: float, se: float, dof: int) -> float:
    """The two-sided Student-t p-value of ``d`` = 0 with standard error ``se`` and ``dof``
    degrees of freedom (nan when either is unknown)."""
    if not (math.isfinite(d) and math.isfinite(se) and dof >= 1):
        return math.nan
    if se == 0:
        return 1.0 if d == 0 else 0.0
    return max(0.0, 1.0 - t_cdf_two_sided(abs(d) / se, dof))


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of the p-values ``ps`` (the family-wise error over the ones
    that are not nan; nan stays nan): sorted ascending, the k-th smallest (0-based) is multiplied
    by m - k and the running maximum taken, capped at 1."""
    known = sorted((p, i) for i, p in enumerate(ps) if not math.isnan(p))
    out, running = [math.nan] * len(ps), 0.0
    for k, (p, i) in enumerate(known):
        running = max(running, min(1.0, (len(known) - k) * p))
        out[i] = running
    return out


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


def _by_seed(values: Mapping[int, float] | Sequence[float]) -> dict[int, float]:
    return dict(values) if isinstance(values, Mapping) else dict(enumerate(values))


def t_cdf_two_sided(t: float, dof: int) -> float:
    """P(|T| <= t) for Student's t with an integer ``dof`` >= 1 (the closed forms in
    theta = atan(t / sqrt(dof)): odd dof (2/pi)(theta + sin cos (1 + 2/3 cos^2 + ...)), even dof
    sin (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ...))."""
    if dof < 1:
        raise ValueError(f"dof must be an int >= 1, got {dof!r}")
    theta = math.atan(abs(t) / math.sqrt(dof))
    c2, sin, cos = math.cos(theta) ** 2, math.sin(theta), math.cos(theta)
    if dof % 2:
        term, total = 1.0, 1.0 if dof > 1 else 0.0
        for k in range(1, (dof - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return (2 / math.pi) * (theta + sin * cos * total)
    term, total = 1.0, 1.0
    for k in range(1, dof // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return sin * total


def t_quantile(confidence: float, dof: int) -> float:
    """The half-width factor t of the two-sided ``confidence`` interval of Student's t with
    ``dof`` degrees of freedom: P(|T| <= t) = confidence (bisection on ``t_cdf_two_sided``)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    lo, hi = 0.0, 1.0
    while t_cdf_two_sided(hi, dof) < confidence:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf_two_sided(mid, dof) < confidence else (lo, mid)
    return (lo + hi) / 2


def decide(a: Mapping[int, float] | Sequence[float], b: Mapping[int, float] | Sequence[float],
           kind: str, *, paired: bool = False, floor: float | None = None,
           ceiling: float | None = None, margin: float = REL_MARGIN,
           margin_abs: float | None = None, eval_se: float | None = None) -> Verdict:
    """The verdict rule (docs/reproductions.md, "The verdict rule"); ``a`` and ``b`` are each
    side's values by seed (a sequence: seeds 0, 1, ...), lower is better.

    - No value on a side, both sides diverged (NaN), both at or above ``floor`` (not learned),
      or both at or below ``ceiling`` (perfect): **not measured**, the comparison says nothing.
    - One side diverged: it is infinitely bad.
    - d = mean(B) - mean(A); paired (``paired`` and >= 2 seeds in common): d is the mean of the
      per-seed differences over the common seeds and its standard error their spread /
      sqrt(n), with n - 1 degrees of freedom; unpaired: Welch's sqrt(s_a^2/n_a + s_b^2/n_b)
      with the Welch-Satterthwaite degrees of freedom (rounded down), with >= 2 seeds per side,
      else unknown. ``eval_se``: the standard error that the finite set of evaluation windows
      adds (``window_se``), added in quadrature. noise = the half-width of the two-sided
      ``CONFIDENCE`` Student-t interval, t x the standard error; margin = ``margin`` x
      |mean(B)| (default REL_MARGIN), or ``margin_abs`` when given: the claimed size.
    - ``better`` (A < B): with e = d and the interval [e - noise, e + noise], **reproduced** if
      the interval's lower end is above 0 and e is at least the margin; **not reproduced** if
      the interval lies entirely below 0 (a resolved opposite effect, whatever its size);
      **right direction, smaller than claimed** if it lies above 0 and below the margin; **no
      effect** if it contains 0 and lies inside +-margin; else inconclusive. ``degrades`` (A >
      B): the same with e = -d.
    - ``not_worse`` (A <= B): reproduced if A's excess -d is within the margin even at its noisy
      worst (-d + noise <= margin); not reproduced if -d - noise > margin; else inconclusive.
    - ``flat`` (A ~ B, an equality test): reproduced if the whole interval lies within
      +-margin (|d| + noise <= margin); not reproduced if it lies outside (|d| - noise > margin);
      else inconclusive.
    - Seeds: with fewer than ``MIN_SEEDS`` (pairs, or on the smaller side) a measured verdict
      becomes inconclusive; a decided verdict whose |d| is within ``NEAR_FACTOR`` x the margin
      (for a directional claim refuted by an opposite effect: the default 1 % margin, or the
      claim's absolute one) needs ``NEAR_SEEDS`` seeds, else it is inconclusive too (the reason
      says so)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    sa, sb = _by_seed(a), _by_seed(b)
    ma, spa = mean_spread(list(sa.values()))
    mb, spb = mean_spread(list(sb.values()))
    out = Verdict(NOT_MEASURED, ma, spa, mb, spb, math.nan, math.nan, math.nan, len(sa), len(sb))
    if not sa or not sb:
        out.reason = "no run reports " + ("either side" if not sa and not sb else "A" if not sa else "B")
        return out
    if math.isinf(ma) and math.isinf(mb):
        out.reason = "both sides diverged"
        return out
    if math.isinf(ma) or math.isinf(mb):
        a_lower = math.isinf(mb)
        out.d = math.inf if a_lower else -math.inf
        out.reason = f"{'B' if a_lower else 'A'} diverged"
        wins = {"better": a_lower, "not_worse": a_lower, "degrades": not a_lower, "flat": False}
        out.verdict = REPRODUCED if wins[kind] else NOT_REPRODUCED
        return out
    if floor is not None and ma >= floor and mb >= floor:
        out.reason = f"both sides at or beyond the floor of learning ({floor:g}): neither learned"
        return out
    if ceiling is not None and ma <= ceiling and mb <= ceiling:
        out.reason = f"both sides at the ceiling ({ceiling:g}): the comparison cannot separate them"
        return out
    common = sorted(set(sa) & set(sb))
    out.margin = margin * abs(mb) if margin_abs is None else margin_abs
    if paired and len(common) >= 2:
        out.paired = True
        out.diffs = {s: sb[s] - sa[s] for s in common}
        n = len(common)
        out.d = statistics.fmean(out.diffs.values())
        out.se, out.dof = statistics.stdev(out.diffs.values()) / math.sqrt(n), n - 1
    else:
        out.d = mb - ma
        n = min(len(sa), len(sb))
        if len(sa) > 1 and len(sb) > 1:
            va, vb = spa ** 2 / len(sa), spb ** 2 / len(sb)
            dof = ((va + vb) ** 2 / (va ** 2 / (len(sa) - 1) + vb ** 2 / (len(sb) - 1))
                   if va + vb > 0 else len(sa) + len(sb) - 2)
            out.se, out.dof = math.sqrt(va + vb), max(1, math.floor(dof + 1e-9))
        if paired and common:
            out.diffs = {s: sb[s] - sa[s] for s in common}
    if eval_se is not None and math.isfinite(eval_se) and math.isfinite(out.se):
        out.eval_se = eval_se
        out.se = math.sqrt(out.se ** 2 + eval_se ** 2)
    if math.isfinite(out.se):
        out.noise = t_quantile(CONFIDENCE, out.dof) * out.se
        out.p = p_value(out.d, out.se, out.dof)
    noise = 0.0 if math.isnan(out.noise) else out.noise
    d, margin = out.d, out.margin
    near = margin
    if kind in ("better", "degrades"):
        e = d if kind == "better" else -d
        lo, hi = e - noise, e + noise
        if lo > 0 and e >= margin:
            out.verdict = REPRODUCED
        elif hi < 0:
            out.verdict = NOT_REPRODUCED
            # a refutation's size is judged against the default margin (a collapse's 10 % is
            # the size claimed, not the size of an opposite effect that refutes it)
            near = margin if margin_abs is not None else min(margin, REL_MARGIN * abs(mb))
        elif lo > 0 and hi < margin:
            out.verdict = SMALLER
        elif -margin < lo and hi < margin:
            out.verdict = NO_EFFECT
        else:
            out.verdict = INCONCLUSIVE
            out.reason = ("right direction (the interval above 0), size undecided: the interval "
                          "reaches the margin" if lo > 0 else
                          "the interval holds 0 and reaches beyond the margin")
    elif kind == "not_worse":
        excess = -d
        out.verdict = (REPRODUCED if excess + noise <= margin else
                       NOT_REPRODUCED if excess - noise > margin else INCONCLUSIVE)
    else:
        out.verdict = (REPRODUCED if abs(d) + noise <= margin else
                       NOT_REPRODUCED if abs(d) - noise > margin else INCONCLUSIVE)
    if math.isnan(out.noise):
        out.reason = "one seed on a side: the noise is unknown"
    decided = out.verdict != INCONCLUSIVE
    if decided and n < MIN_SEEDS:
        out.reason = (f"{n} seed{'s' if n != 1 else ''}{' in common' if out.paired else ''}, "
                      f"fewer than {MIN_SEEDS}: no verdict (the data alone would say "
                      f"{out.verdict})")
        out.verdict = INCONCLUSIVE
    elif decided and n < NEAR_SEEDS and abs(d) < NEAR_FACTOR * near:
        out.reason = (f"|d| within {NEAR_FACTOR:g} x the margin needs {NEAR_SEEDS} seeds, has "
                      f"{n} (the data alone would say {out.verdict})")
        out.verdict = INCONCLUSIVE
    return out


RULE_TEXT = (
    "Verdict rule (docs/reproductions.md, \"The verdict rule\"; lower is better for every "
    "quantity): d = mean(B) - mean(A); where both sides "
    "share seeds and a seed fixes the data order (or both sides come from the same run), d is "
    "the mean of the per-seed differences over the common seeds (paired), otherwise the "
    "difference of the means (unpaired, Welch). noise = the half-width of the two-sided "
    f"{CONFIDENCE:.0%} Student-t interval of d (n - 1 degrees of freedom paired, "
    "Welch-Satterthwaite unpaired; where the runs recorded their per-window losses, the "
    "evaluation windows' standard error is added in quadrature); margin = the claimed size: "
    f"{REL_MARGIN:.0%} of |mean(B)| unless the claim states a share or an absolute difference. "
    "\"A < B\" (better), with the interval [d - noise, d + noise]: **reproduced** if its lower "
    "end is above 0 and d is at least the margin; **not reproduced** if it lies entirely below "
    "0 (a resolved opposite effect, whatever its size); **right direction, smaller than "
    "claimed** if it lies above 0 and below the margin; **no effect** if it holds 0 and lies "
    "inside +-margin; otherwise inconclusive. \"A > B\" (degrades) the same with -d. \"A <= B\" "
    "(no worse): reproduced if A's excess over B stays within the margin at its noisy worst "
    "(-d + noise <= margin), not reproduced if -d - noise > margin. \"A ~ B\" (equal, where a "
    "paper says two things match): reproduced if the whole interval lies within +-margin (|d| "
    "+ noise <= margin), not reproduced if it lies outside (|d| - noise > margin). Seeds: every "
    "claim of a record is judged on the same seeds, those every model of its claims has (a "
    f"seed added to one claim is added to all); fewer than {MIN_SEEDS} (pairs) give no verdict "
    f"(inconclusive), and a verdict whose |d| is within {NEAR_FACTOR:g} x the margin needs "
    f"{NEAR_SEEDS}. **Not measured**: a side without runs, both sides diverged, both sides at "
    "the claim's floor of learning (chance, 0 % accuracy) or both at its ceiling (100 %), a "
    "run of either side that fails its experiment's trained bar, or a test that cannot "
    "separate the two sides: such a comparison says nothing either way. A diverged run (NaN) "
    "counts as infinitely bad. With one seed the noise is unknown: no verdict. p (Holm): the "
    "two-sided p-value of d = 0, Holm-adjusted over the record's claims (the verdicts use the "
    "unadjusted interval; the column says which effects survive the correction for judging "
    "many claims at once).")


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


def finished_results(out: Path) -> list[dict[str, Any]]:
    """Every finished run's result in ``out`` (its ``runs/*/result.json``), in folder order."""
    found = []
    for path in sorted((out / RUNS).glob(f"*/{RESULT_FILE}")):
        with contextlib.suppress(OSError, ValueError):
            result = json.loads(path.read_text())
            if isinstance(result, dict) and "metrics" in result:
                found.append(result)
    return found


def save_result(out: Path, spec: RunSpec, result: dict[str, Any]) -> None:
    path = out / RUNS / spec.key / RESULT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(result, indent=2) + "\n").encode())


# ------------------------------------------------------------------------------- the tables


def read_csv(path: Path) -> list[dict[str, Any]]:
    """The rows ``write_csv`` wrote: base fields typed back, every other non-empty cell a float
    metric (``nan`` for a diverged run)."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ReproduceError(f"cannot read {path}: {err.strerror or err}") from None
    rows = []
    for r in csv.DictReader(io.StringIO(text)):
        missing = [k for k in BASE_FIELDS if k not in r]
        if missing:
            raise ReproduceError(f"{path} is not a reproduction's results.csv (no {missing[0]!r} column)")
        rows.append({"experiment": r["experiment"], "model": r["model"], "seed": int(r["seed"]),
                     "parameters": int(r["parameters"]), "steps": int(r["steps"]),
                     "tokens": int(r["tokens"]), "seconds": float(r["seconds"]),
                     "metrics": {k: float(v) for k, v in r.items()
                                 if k not in BASE_FIELDS and v not in ("", None)}})
    return rows


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


def write_windows(path: Path, results: list[dict[str, Any]]) -> bool:
    """``windows.csv``: one line per (run, metric) that recorded its per-window evaluation
    losses (a result's ``windows``: metric -> [W] values, in the order of the experiment's
    evaluation windows, the same for every run): model, seed, metric and the W values separated
    by spaces. False (no file written, an old one removed) when no run recorded any."""
    lines = [(r["model"], r["seed"], metric, " ".join(f"{x:.6g}" for x in vals))
             for r in results for metric, vals in (r.get("windows") or {}).items()]
    if not lines:
        path.unlink(missing_ok=True)
        return False
    text = io.StringIO(newline="")
    w = csv.writer(text)
    w.writerow(["model", "seed", "metric", "values"])
    w.writerows(lines)
    write_atomic(path, text.getvalue().encode())
    return True


def read_windows(path: Path) -> dict[tuple[str, int, str], list[float]] | None:
    """What ``write_windows`` wrote, (model, seed, metric) -> per-window values; None without
    the file (a record whose runs did not keep them)."""
    if not path.is_file():
        return None
    return {(r["model"], int(r["seed"]), r["metric"]): [float(x) for x in r["values"].split()]
            for r in csv.DictReader(io.StringIO(path.read_text()))}


TRAINED = "trained"  # a metric: 1 if the run's model learned, 0 if its loss stayed stuck


def trained(row: dict[str, Any]) -> bool:
    """False for a run its experiment flagged as not trained (metric ``trained`` = 0)."""
    flag = row["metrics"].get(TRAINED)
    return flag is None or not (isinstance(flag, (int, float)) and flag == 0)


def values(rows: list[dict[str, Any]], model: str, metric: str) -> list[float]:
    """The metric of every seed of ``model``."""
    return list(seed_values(rows, model, metric, only_trained=False).values())


def seed_values(rows: list[dict[str, Any]], model: str, metric: str, *,
                only_trained: bool = True) -> dict[int, float]:
    """seed -> the metric of ``model``'s run of that seed (runs flagged as not trained left out
    unless ``only_trained=False``)."""
    out = {}
    for r in rows:
        if r["model"] == model and metric in r["metrics"] and (trained(r) or not only_trained):
            v = r["metrics"][metric]
            out[int(r["seed"])] = math.nan if v is None else float(v)
    return out


UNTRAINED = "did not train"  # the default name of an experiment's trained bar, failed


def judged_seeds(rows: list[dict[str, Any]], claims: list[Claim]) -> list[int]:
    """The seeds every claim of a record is judged on: those that every model of its claims
    (and controls) has a run of. A seed added to some models only (to settle the claims still
    open) is left out of every verdict, so that no claim's seeds depend on its earlier result.
    Models without any run do not count (their claims are not measured)."""
    have = [{r["seed"] for r in rows if r["model"] == m}
            for m in dict.fromkeys(m for c in claims for m in (c.a[0], c.b[0]))]
    have = [s for s in have if s]
    return sorted(set.intersection(*have)) if have else sorted({r["seed"] for r in rows})


def window_se(windows: Mapping[tuple[str, int, str], Sequence[float]], a: tuple[str, str],
              b: tuple[str, str], seeds: Sequence[int]) -> float | None:
    """The standard error of a claim's d that comes from its finite set of evaluation windows:
    per window w, D_w = mean over ``seeds`` of B's loss on w minus mean over seeds of A's (the
    windows are the same for every run of a record), and sd_w(D_w) / sqrt(W). None unless every
    run of both sides recorded its per-window values of the metric (``windows``: (model, seed,
    metric) -> per-window values)."""
    sides = []
    for model, metric in (a, b):
        runs = [windows.get((model, s, metric)) for s in seeds]
        if not runs or any(r is None for r in runs) or len({len(r) for r in runs}) != 1:
            return None
        sides.append([statistics.fmean(col) for col in zip(*runs)])
    if len(sides[0]) != len(sides[1]) or len(sides[0]) < 2:
        return None
    diff = [y - x for x, y in zip(*sides)]
    return statistics.stdev(diff) / math.sqrt(len(diff))


def judge(rows: list[dict[str, Any]], claims: list[Claim], *, untrained: str = UNTRAINED,
          windows: Mapping[tuple[str, int, str], Sequence[float]] | None = None
          ) -> list[tuple[Claim, Verdict]]:
    """Each claim's verdict (``decide``) on the record's ``judged_seeds``; a run of either side
    that fails its experiment's trained bar (metric ``trained`` = 0; ``untrained`` names the
    bar, e.g. "not below the count bigram's loss") makes the claim *not measured* (no verdict
    rests on a model that did not learn), its numbers shown. ``windows``: the runs' per-window
    losses, where recorded (``window_se``). Each verdict's ``p_holm``: its p-value Holm-adjusted
    over the measured claims (and separately over the controls)."""
    seeds = set(judged_seeds(rows, claims))
    rows = [r for r in rows if r["seed"] in seeds]
    out = []
    for c in claims:
        se = None if windows is None else window_se(windows, c.a, c.b, sorted(seeds))
        v = decide(seed_values(rows, *c.a, only_trained=False), seed_values(rows, *c.b, only_trained=False),
                   c.kind, paired=c.paired, floor=c.floor, ceiling=c.ceiling, margin=c.margin,
                   margin_abs=c.margin_abs, eval_se=se)
        if c.unmeasured:
            v.verdict, v.reason = NOT_MEASURED, c.unmeasured
        stuck = [f"{model} seed {r['seed']}" for model in dict.fromkeys((c.a[0], c.b[0]))
                 for r in rows if r["model"] == model and not trained(r)]
        if stuck:
            note = f"{untrained}: {', '.join(stuck)}"
            v.reason = (note if not v.reason else f"{v.reason}; also {note}" if v.verdict == NOT_MEASURED
                        else f"{note}; {v.reason}")
            v.verdict = NOT_MEASURED
        out.append((c, v))
    for control in (False, True):
        family = [v for c, v in out if c.control == control and v.verdict != NOT_MEASURED]
        for v, adj in zip(family, holm([v.p for v in family])):
            v.p_holm = adj
    return out


def _signed(x: float) -> str:
    return "n/a" if math.isnan(x) else ("+inf" if x == math.inf else "-inf" if x == -math.inf
                                         else f"{x:+.3g}")


def _p(x: float) -> str:
    return "n/a" if math.isnan(x) else "< 1e-4" if x < 1e-4 else f"{x:.2g}"


def claims_table(judged: list[tuple[Claim, Verdict]]) -> str:
    """One row per claim: the claim, the paper's statement and its direction, both sides, the
    difference with its per-seed values, its interval, the margin and the p-values, the verdict
    (and why)."""
    lines = ["| claim | paper (where; direction) | source | ours: A vs B (mean ± sd over seeds) | "
             "d = B - A (per seed); interval, noise, margin; p (Holm) | verdict |",
             "|---|---|---|---|---|---|"]
    for c, v in judged:
        rel, meaning = KINDS[c.kind]
        ours = (f"A = {c.a[0]} [{c.a[1]}] {fmt(v.mean_a, v.spread_a)} {rel} "
                f"B = {c.b[0]} [{c.b[1]}] {fmt(v.mean_b, v.spread_b)} (n = {v.n_a}, {v.n_b})")
        if math.isnan(v.d) and not v.diffs:
            diff = "n/a"
        else:
            per = ", ".join(f"s{k} {_signed(x)}" for k, x in sorted(v.diffs.items()))
            kind = "paired" if v.paired else "unpaired"
            kind += f", n = {len(v.diffs)}" if v.paired else ""
            lo, hi = v.interval
            windows = "" if math.isnan(v.eval_se) else f" (windows' se {v.eval_se:.2g})"
            diff = (f"{_signed(v.d)} ({kind}{': ' + per if per else ''}); "
                    + ("" if math.isnan(v.noise) else f"interval [{_signed(lo)}, {_signed(hi)}], ")
                    + f"noise {'n/a' if math.isnan(v.noise) else f'{v.noise:.2g}'}{windows}, margin "
                    f"{'n/a' if math.isnan(v.margin) else f'{v.margin:.2g}'}"
                    + ("" if math.isnan(v.p) or v.verdict == NOT_MEASURED else
                       f"; p {_p(v.p)} (Holm {_p(v.p_holm)})"))
        verdict = f"**{v.verdict}**" + (f" ({v.reason})" if v.reason else "")
        source = c.source or ("control" if c.control else "n/a")
        lines.append(f"| {c.name} | {c.paper} ({meaning}) | {source} | {ours} | {diff} | {verdict} |")
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
                   seeds: Sequence[int], seconds: float | None) -> None:
    """results.md; ``seconds`` None: rendered from a recorded results.csv, nothing trained."""
    total = sum(r["seconds"] for r in rows)
    when = ("Rendered from the recorded results.csv (no training in this invocation)"
            if seconds is None else
            f"Wall time of this invocation: {seconds:.0f} s (runs finished earlier and reused are "
            "not included)")
    used = judged_seeds(rows, [c for c, _ in judged])
    extra = [f"{m} seed{'s' if len(ss) > 1 else ''} {', '.join(map(str, ss))}"
             for m in dict.fromkeys(r["model"] for r in rows)
             if (ss := sorted(r["seed"] for r in rows if r["model"] == m and r["seed"] not in used))]
    left = (f" The verdicts use seeds {', '.join(map(str, used))}, which every model of the "
            "claims has; left out of them (a seed added to one claim is added to all, or to "
            f"none): {'; '.join(extra)}." if extra else "")
    parts = [f"# {title}", "", intro, "",
             (f"Seeds: {', '.join(map(str, seeds))}. {when}; the runs' own times add up to "
              f"{total:.0f} s (results.csv has each).{left}"), "",
             "Settings: " + ", ".join(f"{k} = {v}" for k, v in settings.items()), "",
             "## Claims", "", claims_table([(c, v) for c, v in judged if not c.control]), "",
             *(["## Controls (checks of the experiment itself, not claims of the paper)", "",
                claims_table([(c, v) for c, v in judged if c.control]), ""]
               if any(c.control for c, _ in judged) else []),
             RULE_TEXT, "",
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


def sweep_plot(path: Path, rows: list[dict[str, Any]], points: dict[int, str], metric: str, *,
               xlabel: str, ylabel: str, title: str, references: Sequence[str] = ()) -> bool:
    """Mean ± sd of ``metric`` against a swept size (``points``: size -> model label, log2 x
    axis), with each ``references`` model's mean as a labelled horizontal line; False without
    matplotlib, or when none of the swept models has run (a reproduction of some models only)."""
    plt = matplotlib_pyplot()
    if plt is None:
        return False
    xs = sorted(points)
    stats = [mean_spread(values(rows, points[x], metric)) for x in xs]
    if not any(math.isfinite(m) for m, _ in stats):  # none of the swept models ran (a subset)
        return False
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.errorbar(xs, [m for m, _ in stats], yerr=[sd if math.isfinite(sd) else 0 for _, sd in stats],
                marker="o", capsize=3)
    for label, ls in zip(references, ("--", ":", "-.", (0, (1, 3)))):
        mean = mean_spread(values(rows, label, metric))[0]
        if not math.isfinite(mean):
            continue
        ax.axhline(mean, ls=ls, color="grey", lw=1)
        ax.text(xs[-1], mean, f" {label}", va="bottom", ha="right", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
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
    ``notes(plan, rows)`` -> lines for results.md (deviations from the paper, ...);
    ``unmatched``: models whose parameter count is not matched to the rest, by design;
    ``untrained``: what a run flagged ``trained`` = 0 failed (the verdict's reason names it);
    ``seeds``: the record's seeds, the command line's default; ``budget``: what they cost (CPU
    time of one core, from the record), for ``--help``. A run's result may carry ``windows``
    (metric -> per-window losses): the driver writes them to ``windows.csv`` and the verdicts
    add the evaluation windows' noise (``window_se``)."""

    name: str
    title: str
    intro: str
    plan: Callable[[bool, list[int], str], Plan]
    execute: Callable[[RunSpec, Plan, Path], dict[str, Any]]
    claims: Callable[[Plan], list[Claim]]
    metrics: Callable[[Plan], list[str]]
    plots: Callable[[list[dict[str, Any]], Path, Plan], list[str]]
    notes: Callable[[Plan, list[dict[str, Any]]], list[str]]
    unmatched: tuple[str, ...] = ()  # models left out of the parameter matching (by design)
    # the trained bar, named for the verdicts of the runs that fail it (``judge``)
    untrained: str = UNTRAINED
    # the record's seeds (the command line's default) and what they cost on one CPU core
    seeds: tuple[int, ...] = (0, 1, 2, 3)
    budget: str = ""
