"""Configs, blocks, the language model and the mixer registry."""

from .config import LMConfig
from .fla import FlaDeltaNetConfig, FlaDeltaNetLM, from_fla
from .fla_retnet import FlaRetNetConfig, FlaRetNetLM
from .lm import LanguageModel
from .registry import MIXERS, build_mixer, mixer_names, mixer_options

__all__ = [
    "MIXERS",
    "FlaDeltaNetConfig",
    "FlaDeltaNetLM",
    "FlaRetNetConfig",
    "FlaRetNetLM",
    "LMConfig",
    "LanguageModel",
    "build_mixer",
    "from_fla",
    "mixer_names",
    "mixer_options",
]
