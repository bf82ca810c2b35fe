"""``fastweights reproduce NAME``: the papers' claims, one command each (``driver.reproduce``; the
command line is ``fastweights.cli.reproduce``).

Each experiment module defines ``EXPERIMENT`` (``common.Experiment``); ``EXPERIMENTS`` maps the
names to their modules, imported when run."""

from __future__ import annotations

from .common import ReproduceError

EXPERIMENTS = {
    "fwp-recall": "fwp_recall",
    "fwp-lm": "fwp_lm",
    "ttt-ablation": "ttt_ablation",
    "long-context": "long_context",
    "infini-passkey": "infini_passkey",
    "infini-passkey-bytes": "infini_passkey_bytes",
    "infini-passkey-digits": "infini_passkey_digits",
    "transnormer": "transnormer",
    "aft": "aft",
}

__all__ = ["EXPERIMENTS", "ReproduceError"]
