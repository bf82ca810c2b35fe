"""A record's README rendered from its results, as results.md is: ``README.in.md`` holds the prose
with every figure taken from the record written as a placeholder, and ``render_readme`` fills
them in from results.csv and the verdicts (``common.judge``), so that no number in the prose can
drift from the record (docs/reproductions.md, "Records").

Placeholders, ``{{kind | argument | ... | format}}`` (the format is a Python format spec and
optional; a placeholder that names no model, metric or claim of the record is an error):

- ``{{mean | MODEL | METRIC}}``, ``{{sd | MODEL | METRIC}}``: over every run of MODEL in
  results.csv (as the record's Runs table; default ``.3f`` and ``.2g``); ``{{value | MODEL |
  SEED | METRIC}}``: one run's;
- ``{{claim.FIELD | CLAIM}}``: a field of the verdict of the claim or control named CLAIM (its
  full name or a prefix that names one alone): ``d``, ``e`` (d in the claimed direction: -d for
  "degrades"), ``abs`` (|d|), ``lo``, ``hi`` (the interval of d), ``noise``, ``margin``, ``mean_a``,
  ``mean_b``, ``min``, ``max`` (of the per-seed differences), ``pos`` / ``neg`` (how many
  seeds' differences are above / below 0), ``n`` (pairs, or the smaller side), ``p``,
  ``p_holm``, ``verdict`` (bold, as in results.md), ``reason``;
- ``{{table}}`` / ``{{table | controls}}``: the claims (controls) as a short table, each with
  its two sides, d with its interval and seeds, the margin, p (Holm) and the verdict;
- ``{{runs}}``, ``{{runs | MODEL}}``, ``{{models}}``, ``{{seeds}}`` (e.g. 0-5), ``{{judged}}``
  (the seeds the verdicts use), ``{{seconds}}`` (the runs' own times added up), ``{{bigram}}``
  (the trained bar, where recorded);
- ``{{base.KIND | ...}}``: any of the above in the record's base, the record it was grown from
  (a record trained at K times the steps: its experiment's record at the default size,
  ``driver.render``), so that a comparison of the two sizes quotes both from their records.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from .common import Claim, ReproduceError, Verdict, judged_seeds, mean_spread, values

TEMPLATE = "README.in.md"
PLACEHOLDER = re.compile(r"\{\{(.+?)\}\}", re.S)
DEFAULT_FORMAT = {"d": "+.3f", "e": "+.3f", "abs": ".3f", "lo": "+.3f", "hi": "+.3f", "min": "+.3f", "max": "+.3f",
                  "noise": ".3f", "margin": ".3f", "mean_a": ".3f", "mean_b": ".3f", "p": ".2g",
                  "p_holm": ".2g", "n": "d", "pos": "d", "neg": "d", "mean": ".3f", "sd": ".2g",
                  "runs": "d", "models": "d", "seconds": ",.0f", "bigram": ".3f"}


def _span(seeds: list[int]) -> str:
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def _claim(judged: list[tuple[Claim, Verdict]], name: str) -> tuple[Claim, Verdict]:
    exact = [cv for cv in judged if cv[0].name == name]
    found = exact or [cv for cv in judged if cv[0].name.startswith(name)]
    if len(found) != 1:
        raise ReproduceError(f"{TEMPLATE}: claim {name!r} names {len(found)} claims of the record")
    return found[0]


def _field(claim: Claim, v: Verdict, field: str) -> Any:
    diffs = list(v.diffs.values())
    lo, hi = v.interval
    got = {"d": v.d, "e": -v.d if claim.kind == "degrades" else v.d, "abs": abs(v.d), "lo": lo, "hi": hi,
           "noise": v.noise, "margin": v.margin, "mean_a": v.mean_a, "mean_b": v.mean_b,
           "min": min(diffs, default=math.nan), "max": max(diffs, default=math.nan),
           "pos": sum(x > 0 for x in diffs), "neg": sum(x < 0 for x in diffs),
           "n": len(diffs) if v.paired else min(v.n_a, v.n_b), "p": v.p, "p_holm": v.p_holm,
           "verdict": f"**{v.verdict}**", "reason": v.reason}
    if field not in got:
        raise ReproduceError(f"{TEMPLATE}: claim.{field} is not a field ({', '.join(got)})")
    return got[field]


def _short_table(judged: list[tuple[Claim, Verdict]], controls: bool) -> str:
    lines = ["| claim | A vs B (mean over seeds) | d = B - A: estimate [95 % interval], seeds > 0 | "
             "margin | p (Holm) | verdict |", "|---|---|---|---|---|---|"]
    for c, v in judged:
        if c.control != controls:
            continue
        n = len(v.diffs) if v.paired else min(v.n_a, v.n_b)
        lo, hi = v.interval

        def num(x: float, spec: str = "+.3f") -> str:
            return "n/a" if not math.isfinite(x) else format(x, spec)

        sides = f"{num(v.mean_a, '.4g')} vs {num(v.mean_b, '.4g')}"
        if not math.isfinite(v.d):
            diff = "n/a"
        else:
            seeds = (f"; {sum(x > 0 for x in v.diffs.values())} of {n} seeds > 0" if v.paired else
                     f"; unpaired, n = {v.n_a}, {v.n_b}")
            diff = f"{num(v.d)} [{num(lo)}, {num(hi)}]{seeds}"
        p = "" if math.isnan(v.p) or v.verdict == "not measured" else (
            f"{v.p:.2g} ({v.p_holm:.2g})" if math.isfinite(v.p_holm) else f"{v.p:.2g}")
        why = f" ({v.reason.split(':')[0]})" if v.verdict == "not measured" and v.reason else ""
        lines.append(f"| {c.name} | {sides} | {diff} | {num(v.margin, '.3g')} | {p} | **{v.verdict}**{why} |")
    return "\n".join(lines)


Record = tuple[list[dict[str, Any]], list[tuple[Claim, Verdict]]]  # (rows, judged)


def render_readme(text: str, rows: list[dict[str, Any]], judged: list[tuple[Claim, Verdict]],
                  base: Record | None = None) -> str:
    """``text`` (a README.in.md) with every placeholder replaced by its value in the record
    (``base.`` placeholders: in ``base``, the (rows, judged) of the record it was grown from)."""
    models = list(dict.fromkeys(r["model"] for r in rows))

    def value(match: re.Match[str]) -> str:
        parts = [p.strip() for p in " ".join(match.group(1).split()).split("|")]
        kind, args = parts[0], parts[1:]
        spec = None
        if kind.startswith("base."):
            if base is None:
                raise ReproduceError(f"{TEMPLATE}: {{{{{match.group(1)}}}}}: this record has no "
                                     "base record (one trained at K times the steps has its "
                                     "experiment's default-size record beside it)")
            inner = " | ".join([kind.removeprefix("base."), *args])
            return render_readme("{{" + inner + "}}", *base)
        if kind.startswith("claim."):
            field = kind.split(".", 1)[1]
            if len(args) == 2:
                spec = args.pop()
            if len(args) != 1:
                raise ReproduceError(f"{TEMPLATE}: {{{{{match.group(1)}}}}} needs one claim name")
            got, key = _field(*_claim(judged, args[0]), field), field
        elif kind in ("mean", "sd"):
            if len(args) == 3:
                spec = args.pop()
            if len(args) != 2 or args[0] not in models:
                raise ReproduceError(f"{TEMPLATE}: {{{{{match.group(1)}}}}}: no such model in the record")
            got = mean_spread(values(rows, *args))[0 if kind == "mean" else 1]
            if all(args[1] not in r["metrics"] for r in rows if r["model"] == args[0]):
                raise ReproduceError(f"{TEMPLATE}: {{{{{match.group(1)}}}}}: no such metric")
            key = kind
        elif kind == "value":
            if len(args) == 4:
                spec = args.pop()
            got = next((r["metrics"].get(args[2]) for r in rows if len(args) == 3 and
                        r["model"] == args[0] and str(r["seed"]) == args[1]), None)
            if got is None:
                raise ReproduceError(f"{TEMPLATE}: {{{{{match.group(1)}}}}}: no such run or metric")
            key = "mean"
        elif kind == "table":
            if args not in ([], ["controls"]):
                raise ReproduceError(f"{TEMPLATE}: {{{{{match.group(1)}}}}}: table or table | controls")
            return _short_table(judged, bool(args))
        elif kind == "runs":
            if args and args[0] not in models:
                raise ReproduceError(f"{TEMPLATE}: {{{{{match.group(1)}}}}}: no such model in the record")
            got, key = len([r for r in rows if not args or r["model"] == args[0]]), "runs"
        elif kind in ("models", "seeds", "judged", "seconds", "bigram"):
            spec = args[0] if args else None
            bars = {r["metrics"]["bigram"] for r in rows if "bigram" in r["metrics"]}
            if kind == "bigram" and len(bars) != 1:
                raise ReproduceError(f"{TEMPLATE}: the record has {len(bars)} bigram bars")
            got = {"models": len(models), "seeds": _span(sorted({r["seed"] for r in rows})),
                   "judged": _span(judged_seeds(rows, [c for c, _ in judged])),
                   "seconds": sum(r["seconds"] for r in rows),
                   "bigram": next(iter(bars), math.nan)}[kind]
            key = kind
        else:
            raise ReproduceError(f"{TEMPLATE}: unknown placeholder {{{{{match.group(1)}}}}}")
        if isinstance(got, str):
            return got
        spec = spec or DEFAULT_FORMAT[key]
        if isinstance(got, float) and not math.isfinite(got):
            return "n/a"
        return format(got, spec)

    return PLACEHOLDER.sub(value, text)


def readme_of(folder: Path, rows: list[dict[str, Any]], judged: list[tuple[Claim, Verdict]],
              base: Record | None = None) -> str | None:
    """The README rendered from ``folder``'s README.in.md, or None when it has none."""
    template = folder / TEMPLATE
    return render_readme(template.read_text(), rows, judged, base) if template.is_file() else None
