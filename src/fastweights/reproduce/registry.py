"""The registry of experiments: every experiment module registers its ``EXPERIMENT`` here when
it is imported (``register``); ``EXPERIMENTS`` maps the names to them, in registration order."""

from __future__ import annotations

from .common import Experiment

EXPERIMENTS: dict[str, Experiment] = {}


def register(experiment: Experiment) -> Experiment:
    """Add ``experiment`` under its name (a second one of the same name is a ValueError)."""
    if experiment.name in EXPERIMENTS:
        raise ValueError(f"experiment {experiment.name!r} is registered twice")
    EXPERIMENTS[experiment.name] = experiment
    return experiment
