"""Configs, blocks, the language model and the mixer registry.

fla's models (``FlaDeltaNetLM``, ``from_fla``, ...) live in ``fastweights.fla``; the names this
package exported before are still found here, looked up on first use.
"""

from typing import Any

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

_FLA_NAMES = ("FlaDeltaNetConfig", "FlaDeltaNetLM", "FlaRetNetConfig", "FlaRetNetLM", "from_fla")


def __getattr__(name: str) -> Any:
    if name in _FLA_NAMES:  # the old path, kept: models.fla re-exports fastweights.fla
        from . import fla

        return getattr(fla, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
