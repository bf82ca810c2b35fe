"""Kept for the old import path: fla compatibility lives in ``fastweights.fla``."""

from ..fla import *  # noqa: F403
from ..fla import __all__  # noqa: F401
