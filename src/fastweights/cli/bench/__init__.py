"""``fastweights bench``: the benchmark suite, and with a name (``fastweights bench NAME``) one of
the focused benchmarks, one module each here. Every one has ``NAME``, ``HELP``,
``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args)``, as the commands do; the work is
``fastweights.bench``'s functions, which return rows. ``python -m fastweights.bench.NAME`` is the
same as ``fastweights bench NAME``."""

from __future__ import annotations

import argparse

from ...bench import gpu
from ..common import HelpFormatter
from . import (
    context_parallel,
    decode,
    family_compare,
    fla_decode,
    fsdp,
    fwp_forms,
    gated_delta,
    gated_delta_models,
    multistream,
    recompute,
    suite,
    ttt_mlp_backward,
    ttt_modes,
)

NAME = "bench"
HELP = suite.HELP
# The focused benchmarks, in the order ``fastweights bench --help`` lists them.
BENCHMARKS = (gpu, decode, multistream, fla_decode, recompute, context_parallel, fsdp, fwp_forms,
              family_compare, ttt_modes, ttt_mlp_backward, gated_delta, gated_delta_models)
DESCRIPTION = (suite.DESCRIPTION + " With a NAME, one of the focused benchmarks instead "
               "(fastweights bench NAME --help).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    suite.add_arguments(p)
    if not BENCHMARKS:
        return
    sub = p.add_subparsers(dest="benchmark", metavar="NAME", required=False,
                           title="focused benchmarks (fastweights bench NAME --help)")
    for bench in BENCHMARKS:
        q = sub.add_parser(bench.NAME, help=bench.HELP, description=bench.DESCRIPTION,
                           formatter_class=HelpFormatter)
        bench.add_arguments(q)
        # The benchmark's own settings, as its results record them.
        q.set_defaults(bench_run=bench.run, settings=[a.dest for a in q._actions if a.dest != "help"])


def run(args: argparse.Namespace) -> int:
    if getattr(args, "benchmark", None):
        return int(args.bench_run(args) or 0)
    return suite.run(args)
