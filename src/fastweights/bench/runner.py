"""The benchmark loop: every (target, T, pass), smallest T first, skipping what would not fit.

For each target the lengths run in increasing order; before each (T, pass) the time of one call
and its peak memory are predicted from the same target and pass at the two largest lengths
measured so far (power law in T, exponent clamped to [1, 2]; exponent 2 while only one length is
known). A config is skipped, with the reason recorded, when two calls are predicted to exceed the
time budget or its peak memory to exceed half of the memory available when the run started;
after a failure (e.g. out of memory) the larger lengths of that target and pass are skipped.
A measured config runs one warm-up call, then ``n`` timed calls where
``n = clamp((budget - 3 t_warm) / t_warm, 1, repeats)``, then one untimed peak-memory call and
one FLOP-counting call (see ``measure``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from .measure import PeakMemory, count_flops, time_call
from .targets import Setting, Target, Workload

__all__ = ["PASSES", "Row", "run_targets"]

PASSES = ("fwd", "fwdbwd", "decode")
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


def _measure(row: Row, call: Callable[[], Any], tokens: int, per_call: int, budget: float,
             repeats: int, device: torch.device, memory: bool) -> None:
    """Fill ``row`` by timing ``call`` (which produces ``per_call`` units: 1 forward pass or
    ``decode_steps`` tokens)."""
    t_warm = time_call(call, device)
    n = max(1, min(repeats, int((budget - 3 * t_warm) / max(t_warm, 1e-9))))
    times = [time_call(call, device) for _ in range(n)]
    with PeakMemory(device, enabled=memory) as peak:  # untimed: see measure's notes
        call()
    flops = count_flops(call)
    median = statistics.median(times)
    row.repeats = n
    row.time_s = median / per_call
    row.tokens_per_s = tokens / median
    row.peak_bytes = math.nan if peak.peak is None else peak.peak
    row.flops = flops / per_call
    row.gflops_per_s = flops / median / 1e9


def _compile_row(row: Row, work: Workload, T: int, budget: float, repeats: int,
                 setting: Setting) -> None:
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
        row.status = f"failed: compile: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        return
    row.max_abs_diff = (got.double() - eager.double()).abs().max().item()
    _measure(row, call, setting.batch * T, 1, budget, repeats, setting.device, memory=False)


def _configs(targets: list[Target], lengths: list[int], passes: list[str]
             ) -> Iterator[tuple[Target, int, str]]:
    for target in targets:
        for T in lengths:
            for pass_name in passes:
                yield target, T, pass_name


def run_targets(targets: list[Target], lengths: list[int], passes: list[str], setting: Setting,
                repeats: int, budget: float, memory_limit: float, memory: bool,
                compile_check: bool = False, progress: bool = True) -> list[Row]:
    """Benchmark every target at every length and pass; returns one Row per config."""
    passes = list(passes) + ([COMPILED_PASS] if compile_check else [])
    rows: list[Row] = []
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
        row = Row(target.name, target.kind, pass_name, T)
        rows.append(row)
        bar.update(1)
        if key in failed:
            row.status = f"skipped: failed at T={failed[key]}"
            continue
        t_pred = _predict(time_hist.get(key, []), T)
        m_pred = _predict(mem_hist.get(key, []), T)
        # Decoding first needs a (untimed) prefill, about one forward pass.
        prefill = 0.0
        if pass_name == "decode":
            prefill = _predict(time_hist.get((target.name, "fwd"), []), T) or 0.0
        if t_pred is not None and 2 * t_pred + prefill > budget:
            row.status = (f"skipped: predicted {t_pred:.3g} s per call (+{prefill:.3g} s prefill),"
                          f" 2 calls exceed the {budget:g} s budget")
            continue
        if m_pred is not None and m_pred > memory_limit:
            row.status = (f"skipped: predicted peak memory {m_pred / 2**30:.2f} GiB > "
                          f"limit {memory_limit / 2**30:.2f} GiB")
            continue
        try:
            work = work_cache.get((target.name, T))
            if work is None:
                work_cache.clear()
                state_cache.clear()
                work = work_cache[(target.name, T)] = target.build(T, setting)
            tokens = setting.batch * T
            if pass_name == "fwd":
                _measure(row, work.forward, tokens, 1, budget, repeats, setting.device, memory)
            elif pass_name == "fwdbwd":
                _measure(row, work.forward_backward, tokens, 1, budget, repeats, setting.device,
                         memory)
            elif pass_name == "decode":
                if work.step is None:
                    row.status = f"skipped: {work.no_decode_reason}"
                    continue
                if (target.name, T) not in state_cache:
                    state_cache[(target.name, T)] = work.prefill()
                state = state_cache[(target.name, T)]
                _measure(row, lambda w=work, st=state: w.step(st),
                         setting.batch * work.decode_steps, work.decode_steps, budget, repeats,
                         setting.device, memory)
            else:
                _compile_row(row, work, T, budget, repeats, setting)
        except Exception as err:
            # out of memory, a kernel or layer error: one config's failure is a result to
            # record; the rest of the run goes on
            row.status = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            failed[key] = T
            work_cache.clear()
            state_cache.clear()
            continue
        time_hist.setdefault(key, []).append((T, row.time_s * (work.decode_steps
                                                               if pass_name == "decode" else 1)))
        if math.isfinite(row.peak_bytes):
            mem_hist.setdefault(key, []).append((T, max(row.peak_bytes, 1.0)))
    bar.close()
    return rows
