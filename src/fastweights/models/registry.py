"""The mixer registry: names -> layer classes with preset options, and ``build_mixer``.

Each entry is a ``MixerEntry``: a layer class, whose options are its constructor's keyword-only
parameters (types and defaults read off the signature, ``Mixer.options``), and the option values
the name presets (``dpfp`` is LinearAttention with
``feature_map="dpfp"``). Options given to ``build_mixer`` override the presets. Add a family by
adding rows to ``MIXERS`` (importing the class from its family's module): a mixer over an
existing op is its class in ``layers/<family>.py`` (options, state, context-parallel strategy)
and its row here; the contract tests, context parallelism's included, pick it up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._checks import check_positive_int
from ..layers.aft import AFTConv, AFTFull, AFTLocal, AFTSimple
from ..layers.base import Mixer, Option
from ..layers.fla_deltanet import FlaDeltaNet
from ..layers.fla_retnet import FlaMultiScaleRetention
from ..layers.fwp import DeltaNet, LinearAttention
from ..layers.gated_delta import GatedDeltaNet
from ..layers.infini import InfiniAttention
from ..layers.softmax import SoftmaxAttention
from ..layers.transnormer import DiagAttention, NormAttention
from ..layers.ttt import TTTMLP, TTTLinear


@dataclass(frozen=True)
class MixerEntry:
    """A registered mixer: the layer class and the option values its name presets."""

    cls: type[Mixer]
    preset: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.preset) - set(self.cls.options))
        if unknown:  # a registry typo, caught at import
            raise ValueError(f"preset option(s) {unknown} are not options of {self.cls.__name__}")

    def options(self) -> dict[str, Option]:
        """The keyword options with their types and defaults (the presets as defaults)."""
        return {k: o._replace(default=self.preset.get(k, o.default))
                for k, o in self.cls.options.items()}

    def __call__(self, d_model: int, n_heads: int, **options: Any) -> Mixer:
        return self.cls(d_model, n_heads, **{**self.preset, **options})


_LINEAR = {"normalize": "attention", "update": "sum"}
MIXERS: dict[str, MixerEntry] = {
    "softmax": MixerEntry(SoftmaxAttention),
    "linear": MixerEntry(LinearAttention, {"feature_map": "elu", **_LINEAR}),
    "dpfp": MixerEntry(LinearAttention, {"feature_map": "dpfp", "nu": 2, **_LINEAR}),
    "favor": MixerEntry(LinearAttention, {"feature_map": "favor", "m": 16, **_LINEAR}),
    "delta": MixerEntry(DeltaNet),
    "infini": MixerEntry(InfiniAttention),
    "norm": MixerEntry(NormAttention),
    "diag": MixerEntry(DiagAttention),
    "aft-full": MixerEntry(AFTFull),
    "aft-local": MixerEntry(AFTLocal),
    "aft-simple": MixerEntry(AFTSimple),
    "aft-conv": MixerEntry(AFTConv),
    "ttt-linear": MixerEntry(TTTLinear),
    "ttt-mlp": MixerEntry(TTTMLP),
    "gated-delta": MixerEntry(GatedDeltaNet),
    "fla-delta": MixerEntry(FlaDeltaNet),
    "retnet": MixerEntry(FlaMultiScaleRetention),
}


def mixer_names() -> list[str]:
    """Registered mixer names, in registration order."""
    return list(MIXERS)


def mixer_option_specs(name: str) -> dict[str, Option]:
    """The keyword options ``name`` accepts, with their types and defaults (after presets)."""
    return _entry(name).options()


def mixer_options(name: str) -> dict[str, Any]:
    """The keyword options ``name`` accepts, with their defaults (after the registry's presets)."""
    return {k: o.default for k, o in mixer_option_specs(name).items()}


def _entry(name: str) -> MixerEntry:
    if not isinstance(name, str) or name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; registered mixers: {', '.join(MIXERS)}")
    return MIXERS[name]


def build_mixer(name: str, d_model: int, n_heads: int, **options: Any) -> Mixer:
    """Build the registered mixer ``name`` for width ``d_model`` with ``n_heads`` heads.

    ``options`` are the layer's keyword options (feature map, normalisation, nu, m, window, ...);
    an unknown option raises ValueError listing the valid ones.
    """
    entry = _entry(name)
    check_positive_int("d_model", d_model)
    check_positive_int("n_heads", n_heads)
    valid = entry.options()
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for mixer {name!r}; valid options: {sorted(valid)}"
        )
    return entry(d_model, n_heads, **options)


def check_mixer(name: str, d_model: int, n_heads: int, **options: Any) -> None:
    """Raise what ``build_mixer(name, d_model, n_heads, **options)`` would raise (unknown name
    or option, a bad value or combination), by building the layer on the meta device: no memory
    is allocated and the caller's random generator is left untouched."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        build_mixer(name, d_model, n_heads, **options)
