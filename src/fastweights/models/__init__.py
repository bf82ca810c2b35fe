"""Configs, blocks, the language model and the mixer registry (fla's models:
``fastweights.fla``)."""

from .config import LMConfig
from .lm import LanguageModel
from .registry import MIXERS, build_mixer, mixer_names, mixer_options

__all__ = [
    "MIXERS",
    "LMConfig",
    "LanguageModel",
    "build_mixer",
    "mixer_names",
    "mixer_options",
]
