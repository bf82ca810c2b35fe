"""The time budget of ``fastweights bench gpu``: how many calls each timed pass takes, which
items go last, and what the whole run is expected to cost, from the per-row times of the H200
record (benchmarks/results/gpu_h200, docs/gpu.md "`fastweights bench gpu`").

Timing rule (``calls_and_warmup``, applied as the run goes, from the first calls it measures):
every pass's first call is timed apart (compilation, autotuning); a separate untimed warm-up
call follows only where a call is quick (under ``WARM_S``), and the timed calls stop once they
have taken ``PASS_S`` seconds (at least one, at most ``--repeats``). A pass of 12 s (AFT-full's
forward+backward at T 16384 on the H200) is then timed once after its first call, where the
fixed rule (one warm-up and ten calls) spent 140 s on it.

Order (``ordered``): items keep their priority, except that those whose first call is slow
(``SLOW_FIRST_S``: fla's autotuning, the quadratic forms at T 16384) go last, the slowest
last, so that a budget that runs short cuts the fewest rows. An item starts only where its
estimated cost fits what is left (``Run.may_start``); every item that does not is a row
``skipped: time budget`` and is listed in meta.json.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

WARM_S = 0.05  # calls quicker than this get an untimed warm-up call after the first
PASS_S = 1.0  # timed seconds per pass (at least one call, at most --repeats)
SLOW_FIRST_S = 10.0  # items whose first calls take longer than this go last
BUILD_S = 1.0  # building a layer or a model and its inputs, when nothing was measured
DECODE_STEPS = 8  # tokens per timed decoding call (bench/targets.py)

# The H200 record (torch 2.11, Triton 3.6, no fla; benchmarks/results/gpu_h200 run1 and run2,
# B4 d_model 1024, 8 heads of 128, bfloat16): median ms of the layer passes (decode per token)
# at T 4096 and 16384. Rows the runs skipped are estimated and marked: T 16384 as four times
# T 4096 (linear in T), and TTT-MLP's forward+backward likewise from its forward's ratio.
LAYER_MS: dict[tuple[str, int], tuple[float, float, float]] = {
    ("softmax", 4096): (0.84, 3.18, 0.61), ("softmax", 16384): (5.18, 18.97, 0.83),
    ("linear", 4096): (1.38, 4.23, 0.32), ("linear", 16384): (4.06, 14.33, 0.39),
    ("dpfp", 4096): (4.89, 19.61, 0.54), ("dpfp", 16384): (18.15, 72.83, 0.51),
    ("favor", 4096): (1.84, 6.71, 0.80), ("favor", 16384): (4.36, 15.51, 0.62),
    ("delta", 4096): (1.90, 6.69, 0.39), ("delta", 16384): (6.61, 24.51, 0.38),
    ("infini", 4096): (2.28, 6.46, 0.52), ("infini", 16384): (8.26, 23.64, 0.55),
    ("norm", 4096): (1.64, 5.83, 1.03), ("norm", 16384): (4.79, 15.77, 0.54),
    ("diag", 4096): (1.00, 3.87, 0.92), ("diag", 16384): (3.34, 10.23, 0.52),
    ("aft-full", 4096): (268.9, 1368.6, 1.13), ("aft-full", 16384): (1402.4, 12096.1, 1.13),
    ("aft-local", 4096): (8.18, 16.89, 0.85), ("aft-local", 16384): (32.7, 67.6, 0.85),  # est.
    ("aft-simple", 4096): (5.91, 10.83, 0.66), ("aft-simple", 16384): (23.6, 43.3, 0.66),  # est.
    ("aft-conv", 4096): (5.91, 12.68, 1.14), ("aft-conv", 16384): (23.6, 50.7, 1.14),  # est.
    ("ttt-linear", 4096): (6.35, 23.49, 0.90), ("ttt-linear", 16384): (21.79, 85.89, 0.95),
    ("ttt-mlp", 4096): (71.31, 329.8, 1.10), ("ttt-mlp", 16384): (277.0, 1281.0, 1.00),  # est.
    ("gated-delta", 4096): (6.81, 30.26, 1.00), ("gated-delta", 16384): (27.2, 121.0, 1.00),
    ("fla-delta", 4096): (5.96, 19.77, 1.09), ("fla-delta", 16384): (23.8, 79.1, 1.09),  # est.
    ("retnet", 4096): (4.99, 31.53, 1.27), ("retnet", 16384): (20.0, 126.1, 1.27),  # est.
}
# Training step (8 layers, B8 T2048, bfloat16 autocast), ms: measured (run2) where given;
# otherwise softmax's step plus 8 times the layer's forward+backward at T 4096 less half of
# softmax's (the same tokens; softmax's attention costs half at T 2048 x B8), and for
# AFT-full (quadratic in T) half its T 4096 pass: this model gives the measured rows within
# 10 % (linear 64 vs 58, delta 84 vs 83, dpfp 187 vs 182).
TRAIN_MS: dict[str, float] = {"softmax": 42.9, "linear": 58.3, "dpfp": 182.0, "favor": 76.7,
                              "delta": 83.3, "infini": 78.5, "norm": 73.8}
FIRST_S: dict[str, float] = {"default": 2.0, "fla": 150.0}  # first calls of an item, measured


def layer_ms(name: str, T: int) -> tuple[float, float, float]:
    """(forward, forward+backward, decode per token) ms of a layer row: the H200 record's, or
    for a mixer it does not have, delta's (a kernel-backed linear-time layer)."""
    if (name, T) in LAYER_MS:
        return LAYER_MS[name, T]
    fwd, fb, dec = LAYER_MS["delta", 4096]
    return fwd * T / 4096, fb * T / 4096, dec


def train_ms(name: str) -> float:
    """A training step's ms (see ``TRAIN_MS``)."""
    if name in TRAIN_MS:
        return TRAIN_MS[name]
    fb = layer_ms(name, 4096)[1]
    soft = LAYER_MS["softmax", 4096][1]
    per_layer = fb / 2 if name == "aft-full" else fb
    return TRAIN_MS["softmax"] + 8 * (per_layer - soft / 2)


def calls_and_warmup(call_s: float, repeats: int) -> tuple[int, bool]:
    """(timed calls, whether an untimed warm-up call precedes them) for a call of ``call_s``
    seconds: as many as fit ``PASS_S`` (at least one, at most ``repeats``); a warm-up only for
    calls under ``WARM_S``."""
    calls = max(1, min(repeats, int(PASS_S / max(call_s, 1e-9))))
    return calls, call_s < WARM_S


def pass_cost(call_s: float, first_s: float, repeats: int) -> float:
    """Seconds a timed pass costs: its first call, the warm-up if any, the timed calls."""
    calls, warm = calls_and_warmup(call_s, repeats)
    return first_s + (calls + warm) * call_s


@dataclasses.dataclass(frozen=True)
class Cost:
    """An item's expected seconds: ``first`` (its first calls: compilation, autotuning) and
    ``total`` (everything, first calls included)."""

    first: float
    total: float


def layer_cost(name: str, T: int, repeats: int, backend: str = "auto") -> Cost:
    """A ``layers`` item: build, forward (and one more forward, the FLOP count on the PyTorch
    form, taken as the forward's time), forward+backward, and decoding (the prefill, a
    forward, then ``DECODE_STEPS`` tokens a call)."""
    fwd, fb, dec = (ms / 1e3 for ms in layer_ms(name, T))
    first = FIRST_S["fla" if backend == "fla" else "default"] + fb
    total = (BUILD_S + first + pass_cost(fwd, 0.0, repeats) + fwd + pass_cost(fb, 0.0, repeats)
             + fwd + pass_cost(dec * DECODE_STEPS, 0.0, repeats))
    return Cost(first, total)


def train_cost(name: str, repeats: int) -> Cost:
    """A ``train`` item: build, the first step, the timed steps, one more for the peak memory."""
    step = train_ms(name) / 1e3
    first = FIRST_S["default"] + step
    return Cost(first, BUILD_S + first + pass_cost(step, 0.0, repeats) + step)


def ordered(items: Iterable[tuple[str, Cost]]) -> list[str]:
    """Item keys in their given order of priority, but those whose first call takes longer
    than ``SLOW_FIRST_S`` moved to the end, the slowest last."""
    items = list(items)
    quick = [k for k, c in items if c.first <= SLOW_FIRST_S]
    slow = sorted((c.first, i, k) for i, (k, c) in enumerate(items) if c.first > SLOW_FIRST_S)
    return quick + [k for _, _, k in slow]


def required_items(mixers: Iterable[str], lengths: Iterable[int], repeats: int
                   ) -> dict[str, Cost]:
    """The rows issue 43 asks one call to fit: every mixer's layer rows at each length and its
    training step, keyed "layers NAME T" and "train NAME"."""
    mixers, lengths = list(mixers), list(lengths)
    out = {f"layers {n} {T}": layer_cost(n, T, repeats) for T in lengths for n in mixers}
    out |= {f"train {n}": train_cost(n, repeats) for n in mixers}
    return out


def expected_seconds(costs: Mapping[str, Cost]) -> float:
    """The run's expected seconds for ``costs`` (every item run)."""
    return sum(c.total for c in costs.values())
