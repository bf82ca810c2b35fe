"""Forward + backward time of the TransNormer / AFT / Infini-attention mixers against softmax
attention, all measured in one process (the numbers of issue 4's closing note).

    fastweights bench family-compare [--mixers softmax norm diag] [--lengths 1024 4096]


Each mixer is built with its registry defaults at ``--d-model`` / ``--heads`` in float32; one
timed call is ``y, _ = layer(x); y.sum().backward()`` on a fresh ``x`` of shape
[batch, T, d_model] that requires grad (bench/measure.py's ``time_call``: CUDA synchronised on both sides).
After one warm-up call per mixer, the mixers are timed in turn, ``--repeats`` rounds, so that a
load change on a shared machine hits every mixer alike; the table gives the minimum (the best
estimate of the unloaded cost) and the median per mixer, and the ratio of minima to softmax.
Mixers of the default list that are not registered are reported as skipped.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from .._commands import positive_int
from ..models.registry import build_mixer, mixer_names
from .measure import time_call

DEFAULT_MIXERS = ("softmax", "norm", "diag", "aft-full", "aft-local", "aft-simple", "aft-conv", "infini")


def fwd_bwd_call(name: str, T: int, d_model: int, heads: int, batch: int,
                 device: torch.device) -> Callable[[], float]:
    """A function timing one forward + backward of mixer ``name`` on [batch, T, d_model]."""
    torch.manual_seed(0)
    layer = build_mixer(name, d_model, heads).to(device).train()
    x = torch.randn(batch, T, d_model, device=device)

    def once() -> float:
        xi = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)

        def call() -> None:
            y, _ = layer(xi)
            y.sum().backward()

        return time_call(call, device)

    return once


def compare(names: list[str], T: int, d_model: int, heads: int, batch: int, repeats: int,
            device: torch.device) -> list[dict]:
    """Interleaved timings at one length: one row per mixer with min/median seconds."""
    calls = {n: fwd_bwd_call(n, T, d_model, heads, batch, device) for n in names}
    for call in calls.values():
        call()  # warm-up: allocator, kernel selection
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(repeats):
        for n, call in calls.items():
            times[n].append(call())
    rows = [{"mixer": n, "T": T, "min_s": min(ts), "median_s": statistics.median(ts)}
            for n, ts in times.items()]
    base = next((r["min_s"] for r in rows if r["mixer"] == "softmax"), None)
    for r in rows:
        r["vs_softmax"] = None if base is None else r["min_s"] / base
    return rows


def run_family_compare(mixers: list[str], lengths: list[int], *, d_model: int = 512, heads: int = 8,
        batch: int = 1, repeats: int = 5, device: torch.device | str = "cpu") -> list[dict]:
    """``compare`` at every length for the registered ``mixers`` (others reported as skipped);
    prints the table and returns the rows."""
    device = torch.device(device)
    known = set(mixer_names())
    names = [n for n in mixers if n in known]
    skipped = [n for n in mixers if n not in known]
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}, float32, "
          f"batch {batch}, d_model {d_model}, heads {heads}, "
          f"{repeats} interleaved rounds after 1 warm-up")
    if skipped:
        print(f"skipped (not registered): {', '.join(skipped)}")
    rows = [r for T in lengths for r in compare(names, T, d_model, heads, batch, repeats, device)]
    print(f"{'mixer':<12}{'T':>7}{'min ms':>10}{'median ms':>11}{'min / softmax':>15}")
    for r in rows:
        ratio = "" if r["vs_softmax"] is None else f"{r['vs_softmax']:.2f}"
        print(f"{r['mixer']:<12}{r['T']:>7}{1e3 * r['min_s']:>10.1f}{1e3 * r['median_s']:>11.1f}{ratio:>15}")
    return rows


NAME = "family-compare"
DESCRIPTION = ("Time one forward+backward call of each mixer (registry defaults, float32) in "
               "interleaved rounds after a warm-up; prints the minimum and median per mixer and "
               "the ratio of minima to softmax.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mixers", nargs="+", default=list(DEFAULT_MIXERS),
                   help="registered mixer names")
    p.add_argument("--lengths", nargs="+", type=positive_int, default=[1024, 4096],
                   help="sequence lengths T")
    p.add_argument("--d-model", type=positive_int, default=512)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> int:
    run_family_compare(args.mixers, args.lengths, d_model=args.d_model, heads=args.heads,
                       batch=args.batch, repeats=args.repeats, device=args.device)
    return 0
