"""Benchmarks. ``fastweights bench`` is the suite (``suite.py``: every mixer and op over T, with
``targets``, ``runner``, ``measure``, ``report`` and ``peers``); ``fastweights bench NAME`` is one
of the focused benchmarks in ``BENCHMARKS``, each one module, ``NAME.py`` (with underscores for
hyphens), defining ``NAME``, ``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args) -> exit
code``. A benchmark is that module plus its line here; ``fastweights bench NAME`` is its only door.
Every benchmark times and meters memory with ``measure`` and writes its record with ``record``
(docs/benchmarks.md "Records"). This module imports nothing heavy: the command line lists the
benchmarks from it without importing torch, and loads a benchmark's module when it is named
(``load``)."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["BENCHMARKS", "PASSES", "load"]

# The suite's passes: forward, forward+backward, the one-token decoding step.
PASSES = ("fwd", "fwdbwd", "decode")

# name -> the one line ``fastweights bench --help`` shows, in the order it shows them.
BENCHMARKS: dict[str, str] = {
    "gpu": "the prepared GPU benchmark: kernel exactness, op, layer and training-step tables",
    "speeds": "the ops' tables of measured kernel speeds (the backend ranking) from gpu records",
    "decode": "decode memory and speed of a recurrent LM vs softmax attention",
    "multistream": "decoding N streams at their own positions in one batched step, vs softmax",
    "fla-decode": "CPU decoding of fla's DeltaNet vs a transformers Llama of the same shape",
    "recompute": "training-step time and peak memory with and without recompute",
    "context-parallel": "context parallelism: step time, memory per rank, bytes moved, vs N",
    "fsdp": "FSDP vs DDP: model state and peak memory per rank, bytes moved, largest model "
            "per rank",
    "fwp-forms": "time of the fast-weight op forms (chunk, recurrent, naive)",
    "family-compare": "forward+backward time of the TransNormer / AFT / Infini mixers vs "
                      "softmax",
    "ttt-modes": "CPU time of the TTT dual form vs the primal form",
    "ttt-mlp-backward": "TTT-MLP forward+backward: hand-written backward vs autograd vs softmax",
    "gated-delta": "gated_delta_rule vs delta_rule and transformers' fallbacks on CPU",
    "gated-delta-models": "Qwen3.5's gated-delta layer and a small model: transformers' "
                          "fallbacks vs use_fastweights",
}


def load(name: str) -> ModuleType:
    """The module of benchmark ``name`` (imported now: it imports torch)."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; benchmarks: {', '.join(BENCHMARKS)}")
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
