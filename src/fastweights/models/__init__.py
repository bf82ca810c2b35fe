"""Configs, blocks, the language model and the mixer registry."""

from .registry import MIXERS, build_mixer, mixer_names, mixer_options
from .config import LMConfig
from .lm import LanguageModel

__all__ = ["MIXERS", "build_mixer", "mixer_names", "mixer_options", "LMConfig", "LanguageModel"]
