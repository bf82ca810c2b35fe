"""``fastweights reproduce NAME``: the papers' claims, one command each (``driver.reproduce``; the
command line is ``fastweights.cli.reproduce``).

Each experiment module defines ``EXPERIMENT`` (``common.Experiment``) and registers it when
imported (``registry.register``); importing this package imports them all, so ``EXPERIMENTS``
(name -> experiment) lists every one. A new experiment is its module and its import here."""

from __future__ import annotations

from . import (  # noqa: F401  (each registers its EXPERIMENT)
    aft,
    fwp_lm,
    fwp_recall,
    infini_passkey,
    infini_passkey_bytes,
    infini_passkey_digits,
    long_context,
    transnormer,
    ttt_ablation,
)
from .common import ReproduceError
from .registry import EXPERIMENTS

__all__ = ["EXPERIMENTS", "ReproduceError"]
