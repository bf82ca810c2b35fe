"""The benchmark loop: every (target, T, pass), smallest T first, skipping what would not fit.

For each target the lengths run in increasing order; before each (T, pass) the time of one round
(a call at each thread count) and its peak memory are predicted from the same target and pass at
the two largest lengths measured so far (power law in T, exponent clamped to [1, 2]; exponent 2
while only one length is known). A config is skipped, with the reason recorded, when two rounds
are predicted to exceed the time budget or its peak memory to exceed half of the memory available when the run started;
after a failure (e.g. out of memory) the larger lengths of that target and pass are skipped.
A measured config runs one warm-up call at each thread count, then ``n`` timed rounds where
``n = clamp((budget - 3 t_warm) / t_warm, 1, repeats)`` and ``t_warm`` is the warm-up time summed
over the thread counts; round r times one call at each count of ``threads`` in order
(``measure.time_rounds``), so that a speed-up between counts is a median of per-round ratios
measured under the same machine state, not a ratio of two medians taken minutes apart. Then one
untimed peak-memory call per count and one FLOP-counting call (see ``measure``). Each thread
count gets its own Row.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from . import PASSES
from .measure import PeakMemory, count_flops, time_rounds
from .targets import Setting, Target, Workload

__all__ = ["PASSES", "Row", "run_targets"]
COMPILED_PASS = "fwd-compiled"


@dataclass
class Row:
    """One (target, T, pass) result. ``time_s``, ``flops`` and ``peak_bytes`` are per call for
    fwd/fwdbwd and per generated token for decode; ``status`` is ``ok``, ``skipped: why`` or
    ``failed: why``."""

    target: str
    kind: str
    pass_name: str
    T: int
    status: str = "ok"
    time_s: float = math.nan
    tokens_per_s: float = math.nan
    peak_bytes: float = math.nan
    flops: float = math.nan
    gflops_per_s: float = math.nan
    repeats: int = 0
    max_abs_diff: float = math.nan  # fwd-compiled only: |compiled - eager|
    threads: int = 1  # torch intra-op threads of this measurement
    time_min_s: float = math.nan  # spread of the rounds (per call / per token like time_s)
    time_max_s: float = math.nan
    speedup: float = math.nan  # over the run's first thread count: median of per-round ratios
    speedup_min: float = math.nan
    speedup_max: float = math.nan


def _predict(history: list[tuple[int, float]], T: int) -> float | None:
    """Power-law extrapolation of ``[(T_i, value_i)]`` to T (None without history)."""
    points = [(t, v) for t, v in history if v > 0 and math.isfinite(v)]
    if not points:
        return None
    if len(points) == 1:
        exponent = 2.0
    else:
        (t1, v1), (t2, v2) = points[-2], points[-1]
        exponent = min(2.0, max(1.0, math.log(v2 / v1) / math.log(t2 / t1)))
    t_last, v_last = points[-1]
    return v_last * (T / t_last) ** exponent


def _measure(rows: list[Row], call: Callable[[], Any], tokens: int, per_call: int,
             budget: float, repeats: int, device: torch.device, memory: bool,
             threads: list[int]) -> None:
    """Fill ``rows`` (one per count of ``threads``) by timing ``call`` (which produces
    ``per_call`` units: 1 forward pass or ``decode_steps`` tokens), thread counts interleaved."""
    t_warm = sum(t[0][0] for t in time_rounds([call], threads, 1, device))
    n = max(1, min(repeats, int((budget - 3 * t_warm) / max(t_warm, 1e-9))))
    times = [t[0] for t in time_rounds([call], threads, n, device)]
    flops = count_flops(call)
    before = torch.get_num_threads()
    for row, count, ts in zip(rows, threads, times):
        torch.set_num_threads(count)
        try:
            with PeakMemory(device, enabled=memory) as peak:  # untimed: see measure's notes
                call()
        finally:
            torch.set_num_threads(before)
        ratios = [first / t for first, t in zip(times[0], ts)]
        median = statistics.median(ts)
        row.repeats = n
        row.time_s, row.time_min_s, row.time_max_s = (x / per_call for x in (median, min(ts),
                                                                              max(ts)))
        row.speedup = statistics.median(ratios)
        row.speedup_min, row.speedup_max = min(ratios), max(ratios)
        row.tokens_per_s = tokens / median
        row.peak_bytes = math.nan if peak.peak is None else peak.peak
        row.flops = flops / per_call
        row.gflops_per_s = flops / median / 1e9


def _compile_rows(rows: list[Row], work: Workload, T: int, budget: float, repeats: int,
                  setting: Setting, threads: list[int]) -> None:
    """torch.compile the layer, report max |compiled - eager| of the forward, and time it."""
    layer, x = work.module, work.x
    torch._dynamo.reset()  # fresh caches: a new layer per T must not hit the recompile limit
    compiled = torch.compile(layer, dynamic=False)
    layer.eval()

    def call() -> torch.Tensor:
        with torch.no_grad():
            return compiled(x)[0]

    eager = work.forward()
    try:
        got = call()  # the compilation happens here
    except Exception as err:  # a compiler failure is a result to report, not a crash
        for row in rows:
            row.status = (f"failed: compile: {type(err).__name__}: "
                          f"{str(err).splitlines()[0][:160]}")
        return
    for row in rows:
        row.max_abs_diff = (got.double() - eager.double()).abs().max().item()
    _measure(rows, call, setting.batch * T, 1, budget, repeats, setting.device, memory=False,
             threads=threads)


def _configs(targets: list[Target], lengths: list[int], passes: list[str]
             ) -> Iterator[tuple[Target, int, str]]:
    for target in targets:
        for T in lengths:
            for pass_name in passes:
                yield target, T, pass_name


def run_targets(targets: list[Target], lengths: list[int], passes: list[str], setting: Setting,
                repeats: int, budget: float, memory_limit: float, memory: bool,
                compile_check: bool = False, progress: bool = True,
                threads: list[int] | None = None) -> list[Row]:
    """Benchmark every target at every length and pass; returns one Row per config and count
    of ``threads`` (None: torch's current count), the counts interleaved round by round."""
    threads = list(threads) if threads else [torch.get_num_threads()]
    passes = list(passes) + ([COMPILED_PASS] if compile_check else [])
    rows: list[Row] = []
    # histories of the time of one round (a call at every thread count) and of peak memory
    time_hist: dict[tuple[str, str], list[tuple[int, float]]] = {}
    mem_hist: dict[tuple[str, str], list[tuple[int, float]]] = {}
    failed: dict[tuple[str, str], int] = {}
    total = sum(len(lengths) * sum(p != COMPILED_PASS or t.kind == "mixer" for p in passes)
                for t in targets)
    bar = tqdm(total=total, desc="bench", unit="cfg", disable=not progress, dynamic_ncols=True)
    work_cache: dict[tuple[str, int], Workload] = {}
    state_cache: dict[tuple[str, int], Any] = {}
    for target, T, pass_name in _configs(targets, lengths, passes):
        if pass_name == COMPILED_PASS and target.kind != "mixer":
            continue
        bar.set_postfix_str(f"{target.name} T={T} {pass_name}")
        key = (target.name, pass_name)
        group = [Row(target.name, target.kind, pass_name, T, threads=n) for n in threads]
        rows += group
        bar.update(1)
        status = _skip_reason(key, target.name, pass_name, T, failed, time_hist, mem_hist,
                              budget, memory_limit)
        if status:
            for row in group:
                row.status = status
            continue
        try:
            work = work_cache.get((target.name, T))
            if work is None:
                work_cache.clear()
                state_cache.clear()
                work = work_cache[(target.name, T)] = target.build(T, setting)
            tokens = setting.batch * T
            if pass_name == "fwd":
                _measure(group, work.forward, tokens, 1, budget, repeats, setting.device, memory,
                         threads)
            elif pass_name == "fwdbwd":
                _measure(group, work.forward_backward, tokens, 1, budget, repeats,
                         setting.device, memory, threads)
            elif pass_name == "decode":
                if work.step is None:
                    for row in group:
                        row.status = f"skipped: {work.no_decode_reason}"
                    continue
                if (target.name, T) not in state_cache:
                    state_cache[(target.name, T)] = work.prefill()
                state = state_cache[(target.name, T)]
                _measure(group, lambda w=work, st=state: w.step(st),
                         setting.batch * work.decode_steps, work.decode_steps, budget, repeats,
                         setting.device, memory, threads)
            else:
                _compile_rows(group, work, T, budget, repeats, setting, threads)
        except Exception as err:
            # out of memory, a kernel or layer error: one config's failure is a result to
            # record; the rest of the run goes on
            for row in group:
                row.status = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            failed[key] = T
            work_cache.clear()
            state_cache.clear()
            continue
        if group[0].status != "ok":
            continue
        per_call = work.decode_steps if pass_name == "decode" else 1
        time_hist.setdefault(key, []).append((T, sum(r.time_s for r in group) * per_call))
        peaks = [r.peak_bytes for r in group if math.isfinite(r.peak_bytes)]
        if peaks:
            mem_hist.setdefault(key, []).append((T, max(max(peaks), 1.0)))
    bar.close()
    return rows


def _skip_reason(key: tuple[str, str], name: str, pass_name: str, T: int,
                 failed: dict[tuple[str, str], int],
                 time_hist: dict[tuple[str, str], list[tuple[int, float]]],
                 mem_hist: dict[tuple[str, str], list[tuple[int, float]]],
                 budget: float, memory_limit: float) -> str:
    """Why the config (target ``name``, T, pass) is skipped, or "" to measure it."""
    if key in failed:
        return f"skipped: failed at T={failed[key]}"
    t_pred = _predict(time_hist.get(key, []), T)
    m_pred = _predict(mem_hist.get(key, []), T)
    # Decoding first needs a (untimed) prefill, about one forward pass.
    prefill = 0.0
    if pass_name == "decode":
        prefill = _predict(time_hist.get((name, "fwd"), []), T) or 0.0
    if t_pred is not None and 2 * t_pred + prefill > budget:
        return (f"skipped: predicted {t_pred:.3g} s per round (+{prefill:.3g} s prefill),"
                f" 2 rounds exceed the {budget:g} s budget")
    if m_pred is not None and m_pred > memory_limit:
        return (f"skipped: predicted peak memory {m_pred / 2**30:.2f} GiB > "
                f"limit {memory_limit / 2**30:.2f} GiB")
    return ""
