"""The mixer registry: names -> layer factories, and ``build_mixer``.

Each entry is a layer class or a ``functools.partial`` fixing its defaults; options given to
``build_mixer`` override those defaults. Add a family by adding rows to ``MIXERS``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from .._checks import check_positive_int
from ..layers import (
    TTTMLP,
    AFTConv,
    AFTFull,
    AFTLocal,
    AFTSimple,
    DeltaNet,
    DiagAttention,
    InfiniAttention,
    LinearAttention,
    Mixer,
    NormAttention,
    SoftmaxAttention,
    TTTLinear,
)

MIXERS: dict[str, Callable[..., Mixer]] = {
    "softmax": SoftmaxAttention,
    "linear": partial(LinearAttention, feature_map="elu", normalize="attention", update="sum"),
    "dpfp": partial(LinearAttention, feature_map="dpfp", nu=2, normalize="attention", update="sum"),
    "favor": partial(LinearAttention, feature_map="favor", m=16, normalize="attention", update="sum"),
    "delta": DeltaNet,
    "infini": InfiniAttention,
    "norm": NormAttention,
    "diag": DiagAttention,
    "aft-full": AFTFull,
    "aft-local": AFTLocal,
    "aft-simple": AFTSimple,
    "aft-conv": AFTConv,
    "ttt-linear": TTTLinear,
    "ttt-mlp": TTTMLP,
}


def mixer_names() -> list[str]:
    """Registered mixer names, in registration order."""
    return list(MIXERS)


def mixer_options(name: str) -> dict[str, Any]:
    """The keyword options ``name`` accepts, with their defaults (after the registry's presets)."""
    factory = _factory(name)
    func, preset = (factory.func, factory.keywords) if isinstance(factory, partial) else (factory, {})
    params: dict[str, Any] = {}
    for cls in (func.__mro__ if inspect.isclass(func) else (func,)):
        init = cls.__init__ if inspect.isclass(cls) else cls
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.KEYWORD_ONLY and p.name not in params:
                params[p.name] = p.default
        if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(init).parameters.values()):
            break
    params.update(preset)
    for fixed in getattr(func, "fixed_options", ()):
        params.pop(fixed, None)
    return params


def _factory(name: str) -> Callable[..., Mixer]:
    if not isinstance(name, str) or name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; registered mixers: {', '.join(MIXERS)}")
    return MIXERS[name]


def build_mixer(name: str, d_model: int, n_heads: int, **options: Any) -> Mixer:
    """Build the registered mixer ``name`` for width ``d_model`` with ``n_heads`` heads.

    ``options`` are the layer's keyword options (feature map, normalisation, nu, m, window, ...);
    an unknown option raises ValueError listing the valid ones.
    """
    factory = _factory(name)
    check_positive_int("d_model", d_model)
    check_positive_int("n_heads", n_heads)
    valid = mixer_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for mixer {name!r}; valid options: {sorted(valid)}"
        )
    return factory(d_model, n_heads, **options)


def check_mixer(name: str, d_model: int, n_heads: int, **options: Any) -> None:
    """Raise what ``build_mixer(name, d_model, n_heads, **options)`` would raise (unknown name
    or option, a bad value or combination), by building the layer on the meta device: no memory
    is allocated and the caller's random generator is left untouched."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        build_mixer(name, d_model, n_heads, **options)
