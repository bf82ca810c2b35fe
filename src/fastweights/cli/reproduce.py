"""``fastweights reproduce NAME``: reproduce a paper's claims (``fastweights.reproduce``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .._commands import UserError, user_errors
from ..reproduce import NAMES, SEEDS

NAME = "reproduce"
DESCRIPTION = ("Train the small models an experiment needs and write results.csv, results.md "
               "(each claim: the paper, ours as mean +- sd over seeds, a verdict) and PNG plots "
               "into --out. Rerunning the same command continues an interrupted reproduction.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help=f"the experiment: {', '.join(NAMES)}")
    defaults = "; ".join(f"{name} {_span(seeds)}, ~{time}" for name, (seeds, time) in SEEDS.items())
    p.add_argument("--seeds", default=None,
                   help="comma-separated seeds, e.g. 0,1,2,3 (default: the record's seeds, "
                        "enough for a verdict, and about what they take on one idle CPU core: "
                        f"{defaults}; --quick: 0)")
    p.add_argument("--quick", action="store_true",
                   help="CI-sized version: every run of the experiment in seconds")
    p.add_argument("--data", default="stdlib",
                   help="byte corpus of the language-model experiments: 'stdlib' or a text file "
                        "or folder")
    p.add_argument("--out", default=None, help="output folder (default: runs/reproduce/NAME)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier reproduction's --out (the same command continues it)")
    p.add_argument("--render", action="store_true",
                   help="train nothing: rewrite results.md in --out from its recorded "
                        "results.csv with the current claims and verdict rule (plots kept)")
    p.add_argument("--steps-factor", type=int, default=1, metavar="K",
                   help="train every run K times the experiment's steps (one step past toy "
                        "scale; default --out runs/reproduce/NAME-Kx)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _span(seeds: tuple[int, ...]) -> str:
    """(0, 1, 2, 3) -> "0-3" (consecutive seeds), else comma-separated."""
    if len(seeds) > 2 and list(seeds) == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ",".join(map(str, seeds))


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> [0, 1, 2]: distinct non-negative ints."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--seeds must be comma-separated non-negative integers, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds must be distinct non-negative integers, got {text!r}")
    return seeds


def run(args: argparse.Namespace) -> int:
    from ..reproduce.common import ReproduceError
    from ..reproduce.driver import experiment, render, reproduce

    with user_errors((ReproduceError,)):
        exp = experiment(args.name)
        seeds = (parse_seeds(args.seeds) if args.seeds is not None else
                 [0] if args.quick else list(SEEDS[exp.name][0]))
        out = (Path(args.out) if args.out else Path("runs") / "reproduce" /
               (exp.name if args.steps_factor == 1 else f"{exp.name}-{args.steps_factor}x"))
        if args.render:
            md = render(out, exp.name)
        else:
            md = reproduce(exp.name, out, seeds, quick=args.quick, data=args.data,
                           overwrite=args.overwrite, progress=not args.quiet,
                           steps_factor=args.steps_factor)
    text = md.read_text()
    claims = text[text.index("## Claims"):text.index("## Runs")].strip()
    print(claims.split("\n\nVerdict rule")[0])
    print(f"\nresults in {md.parent} (results.md, results.csv, plots)")
    return 0
