"""``fastweights reproduce NAME``: the papers' claims, one command each (``driver.reproduce``; the
command line is ``fastweights.cli.reproduce``).

Each experiment is one module, ``NAME.py`` with underscores for hyphens, defining ``EXPERIMENT``
(``common.Experiment``) and registering it when imported (``registry.register``); ``NAMES``
lists them, and ``EXPERIMENTS`` (name -> experiment) imports them all on first use. A new
experiment is its module and its name in ``NAMES``. Importing this package imports nothing
heavy, so that the command line lists the experiments without importing torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .common import Experiment, ReproduceError

__all__ = ["EXPERIMENTS", "NAMES", "SEEDS", "ReproduceError"]

# The experiments, in the order the command line lists them.
NAMES = ("aft", "fwp-lm", "fwp-recall", "infini-passkey", "infini-passkey-bytes",
         "infini-passkey-digits", "long-context", "transnormer", "ttt-ablation")

# Each experiment's default seeds (the command line's, enough for the verdict rule: four, six
# where its claims lie near their margins) and about how long they take at the default size:
# CPU time of the one core a reproduction uses, from the records (benchmarks/results/reproduce/
# NAME/README.md) scaled to these seeds, about the wall time on an idle machine.
SEEDS: dict[str, tuple[tuple[int, ...], str]] = {
    "aft": ((0, 1, 2, 3, 4, 5), "27 min"),
    "fwp-lm": ((0, 1, 2, 3, 4, 5), "29 min"),
    "fwp-recall": ((0, 1, 2, 3), "5 min"),
    "infini-passkey": ((0, 1, 2, 3, 4, 5), "42 min"),
    "infini-passkey-bytes": ((0, 1, 2, 3), "26 min"),
    "infini-passkey-digits": ((0, 1, 2, 3), "31 min"),
    "long-context": ((0, 1, 2, 3, 4, 5), "25 min"),
    "transnormer": ((0, 1, 2, 3, 4, 5), "22 min"),
    "ttt-ablation": ((0, 1, 2, 3, 4, 5), "18 min"),
}


def _experiments() -> dict[str, Experiment]:
    for name in NAMES:  # each module registers its EXPERIMENT when imported
        importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
    from .registry import EXPERIMENTS

    return EXPERIMENTS


def __getattr__(name: str) -> Any:
    if name == "EXPERIMENTS":
        return _experiments()
    if name == "ReproduceError":
        from .common import ReproduceError

        return ReproduceError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
