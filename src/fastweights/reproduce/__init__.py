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

__all__ = ["EXPERIMENTS", "NAMES", "ReproduceError"]

# The experiments, in the order the command line lists them.
NAMES = ("aft", "fwp-lm", "fwp-recall", "infini-passkey", "infini-passkey-bytes",
         "infini-passkey-digits", "long-context", "transnormer", "ttt-ablation")


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
