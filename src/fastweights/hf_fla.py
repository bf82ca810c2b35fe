"""Kept for the old import path: fla's ``transformers`` models live in ``fastweights.fla.hf``."""

from .fla.hf import *  # noqa: F403
from .fla.hf import __all__  # noqa: F401
