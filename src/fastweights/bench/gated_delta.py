"""CPU time of ``gated_delta_rule`` next to our ``delta_rule`` and transformers' PyTorch gated
delta rule, in one process.

``fastweights bench gated-delta [--T 4096] [--threads 1,2] [--out DIR]``
times, at B1 H8 D64 float32 (q, k, v [B, T, H, D], k L2-normalised, beta in (0, 1), g in [-0.1, 0]):

- ``fwd`` and ``fwdbwd`` (forward, and forward plus the backward of sum(o) into q, k, v, beta
  and g): ``gated_delta_rule`` and ``delta_rule`` in their chunked form at each chunk size of
  ``--chunk-sizes``, and transformers' ``torch_chunk_gated_delta_rule`` (the PyTorch fallback
  of Qwen3.5 / Qwen3-Next, unwrapped from its kernel dispatch) at the same chunk sizes;
- ``step`` (one token with a carried state [B, H, D, D], as a decoding step; ``--step-calls``
  calls per timed sample): the public ``gated_delta_rule`` on a one-token input (its checks
  included), ``gated_delta_rule_step`` (the one-token step a layer calls), transformers'
  ``torch_recurrent_gated_delta_rule`` on one token, and ``delta_rule`` on one token.

Both sides get the same computation: transformers' functions always scale q by 1/sqrt(D), so
ours run with scale=D ** -0.5; theirs run with use_qk_l2norm_in_kernel=False (their layer
normalises inside; here k is normalised beforehand for both, q is not normalised for either).

Method: every candidate of a (pass, thread count) is called once as a warm-up, then
``--repeats`` rounds call each candidate once, in an order rotated every round, so that all see
the same machine state; the median counts and the spread is reported as min / max and as the
per-round (paired) ratio to the reference candidate, whose median is robust to load changing
between rounds on a shared machine. Times are wall clock (bench/measure.py ``time_clocks``);
the process CPU time of each call (all threads) is recorded beside it. glibc's allocator is put
in the timing configuration of ``fastweights.bench.measure`` (freed blocks reused, not returned
to the system), for every candidate alike. Thread counts are set with ``torch.set_num_threads`` in
the one process, one after another.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .._commands import (
    command_line,
    parse_int_list,
    parse_name_list,
    positive_int,
    recorded_settings,
    user_errors,
)
from ..ops import delta_rule, gated_delta_rule, gated_delta_rule_step
from .measure import prepare_cpu_memory_accounting, time_clocks
from .record import Record, add_out_arguments, machine, open_record

__all__ = ["GatedDeltaRow", "report_lines", "run_gated_delta", "summary_table"]
PASSES = ("fwd", "fwdbwd", "step")


@dataclasses.dataclass
class GatedDeltaRow:
    """One candidate of one (pass, thread count): wall-clock seconds per call (median, min,
    max over the rounds), process CPU seconds per call (median), and the per-round ratio of
    this candidate's time to the reference's (median, min, max; 1 for the reference itself).
    ``status`` is ``ok`` or ``skipped: why``."""

    pass_: str
    threads: int
    name: str
    reference: str
    status: str = "ok"
    median_s: float = float("nan")
    min_s: float = float("nan")
    max_s: float = float("nan")
    cpu_s: float = float("nan")
    ratio: float = float("nan")
    ratio_min: float = float("nan")
    ratio_max: float = float("nan")
    repeats: int = 0


Call = Callable[[], Any]


def _transformers_fallbacks() -> tuple[Call | None, Call | None, str]:
    """transformers' PyTorch torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule
    (Qwen3.5's, unwrapped from the kernel dispatch that would send them to fla), or Nones and
    why not."""
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen
    except ImportError as e:
        return None, None, f"skipped: transformers' Qwen3.5 is not importable ({e})"
    return (inspect.unwrap(qwen.torch_chunk_gated_delta_rule),
            inspect.unwrap(qwen.torch_recurrent_gated_delta_rule), "ok")


def _inputs(B: int, T: int, H: int, D: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    return {"q": q, "k": F.normalize(k, dim=-1), "v": v,
            "beta": torch.rand(B, T, H, generator=gen),
            "g": -0.1 * torch.rand(B, T, H, generator=gen),
            "S": 0.1 * torch.randn(B, H, D, D, generator=gen)}


def _backward(call: Call, x: dict[str, torch.Tensor]) -> Call:
    """Forward plus the backward of sum(o), the input gradients cleared first."""
    def run() -> None:
        for t in x.values():
            t.grad = None
        call()[0].sum().backward()
    return run


def _candidates(pass_: str, x: dict[str, torch.Tensor], chunk_sizes: list[int],
                step_calls: int) -> tuple[dict[str, Call | str], str]:
    """{name: call, or "skipped: why"} for one pass, and the reference candidate's name."""
    tf_chunk, tf_rec, why = _transformers_fallbacks()
    q, k, v, beta, g = x["q"], x["k"], x["v"], x["beta"], x["g"]
    s = q.shape[-1] ** -0.5
    calls: dict[str, Call | str] = {}
    if pass_ == "step":
        one = {n: t[:, :1] for n, t in x.items() if n != "S"}
        S = x["S"]
        q1, k1, v1, b1, g1 = one["q"], one["k"], one["v"], one["beta"], one["g"]

        def repeat(fn: Call) -> Call:
            def run() -> None:
                for _ in range(step_calls):
                    fn()
            return run

        calls["gated_delta_rule T=1"] = repeat(lambda: gated_delta_rule(
            q1, k1, v1, b1, g1, scale=s, initial_state=S, output_final_state=True))
        calls["gated_delta_rule_step"] = repeat(lambda: gated_delta_rule_step(
            q1, k1, v1, b1, g1, state=S, scale=s))
        calls["transformers torch_recurrent_gated_delta_rule T=1"] = why if tf_rec is None else repeat(
            lambda: tf_rec(q1, k1, v1, g=g1, beta=b1, initial_state=S, output_final_state=True))
        calls["delta_rule T=1"] = repeat(lambda: delta_rule(
            q1, k1, v1, b1, scale=s, initial_state=S, output_final_state=True))
        return calls, "gated_delta_rule T=1"
    for C in chunk_sizes:
        calls[f"gated_delta_rule C={C}"] = lambda C=C: gated_delta_rule(
            q, k, v, beta, g, scale=s, chunk_size=C)
        calls[f"delta_rule C={C}"] = lambda C=C: delta_rule(q, k, v, beta, scale=s, chunk_size=C)
        calls[f"transformers torch_chunk_gated_delta_rule C={C}"] = why if tf_chunk is None else (
            lambda C=C: tf_chunk(q, k, v, g=g, beta=beta, chunk_size=C))
    if pass_ == "fwdbwd":
        calls = {n: c if isinstance(c, str) else _backward(c, x) for n, c in calls.items()}
    return calls, f"gated_delta_rule C={chunk_sizes[0]}"


def _time_rounds(calls: dict[str, Call], repeats: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, process CPU) seconds per call for every candidate over ``repeats`` rounds, after
    one warm-up call each; the calling order rotates by one every round."""
    names = list(calls)
    for name in names:
        calls[name]()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(time_clocks(calls[name], torch.device("cpu"), ("wall", "process")))
    return times


def run_gated_delta(
    T: int = 4096, B: int = 1, H: int = 8, D: int = 64, threads: tuple[int, ...] = (1, 2),
    chunk_sizes: tuple[int, ...] = (64, 32), passes: tuple[str, ...] = PASSES,
    repeats: int = 7, step_calls: int = 100,
) -> list[GatedDeltaRow]:
    """Time every candidate (see the module docstring) per pass and thread count; one row per
    candidate. The reference of the ratios: gated_delta_rule at the first chunk size (fwd,
    fwdbwd) or the public one-token call (step). Step rows are per token (one call)."""
    for name, value in (("T", T), ("B", B), ("H", H), ("D", D), ("repeats", repeats),
                        ("step_calls", step_calls)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not threads or min(threads) < 1:
        raise ValueError(f"threads must be positive thread counts, got {threads}")
    if not chunk_sizes or min(chunk_sizes) < 1:
        raise ValueError(f"chunk_sizes must be positive, got {chunk_sizes}")
    unknown = [p for p in passes if p not in PASSES]
    if unknown or not passes:
        raise ValueError(f"passes must be some of {PASSES}, got {passes}")
    prepare_cpu_memory_accounting()
    before = torch.get_num_threads()
    rows: list[GatedDeltaRow] = []
    try:
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for pass_ in passes:
                x = _inputs(B, T, H, D)
                if pass_ == "fwdbwd":
                    for t in x.values():
                        t.requires_grad_()
                calls, ref = _candidates(pass_, x, list(chunk_sizes), step_calls)
                live = {n: c for n, c in calls.items() if not isinstance(c, str)}
                with torch.enable_grad() if pass_ == "fwdbwd" else torch.no_grad():
                    times = _time_rounds(live, repeats)
                per = step_calls if pass_ == "step" else 1
                for name, call in calls.items():
                    row = GatedDeltaRow(pass_, n_threads, name, ref)
                    rows.append(row)
                    if isinstance(call, str):
                        row.status = call
                        continue
                    wall = [w / per for w, _ in times[name]]
                    ratios = [w / r for (w, _), (r, _) in zip(times[name], times[ref])]
                    row.median_s, row.min_s, row.max_s = statistics.median(wall), min(wall), max(wall)
                    row.cpu_s = statistics.median(c / per for _, c in times[name])
                    row.ratio = statistics.median(ratios)
                    row.ratio_min, row.ratio_max = min(ratios), max(ratios)
                    row.repeats = repeats
    finally:
        torch.set_num_threads(before)
    return rows


def summary_table(rows: list[GatedDeltaRow]) -> list[str]:
    """Markdown lines: one table per pass, a row per (threads, candidate)."""
    lines = []
    for pass_ in PASSES:
        sel = [r for r in rows if r.pass_ == pass_]
        if not sel:
            continue
        unit, scale = ("us per token", 1e6) if pass_ == "step" else ("ms", 1e3)
        lines += [f"### {pass_} ({unit}; ratio = time / time of {sel[0].reference}, per round)",
                  "", "| threads | candidate | median | min | max | CPU time | ratio median "
                  "[min, max] |", "|---:|---|---:|---:|---:|---:|---|"]
        for r in sel:
            if r.status != "ok":
                lines.append(f"| {r.threads} | {r.name} | | | | | {r.status} |")
                continue
            lines.append(f"| {r.threads} | {r.name} | {r.median_s * scale:.4g} | "
                         f"{r.min_s * scale:.4g} | {r.max_s * scale:.4g} | {r.cpu_s * scale:.4g} | "
                         f"{r.ratio:.3f} [{r.ratio_min:.3f}, {r.ratio_max:.3f}] |")
        lines.append("")
    return lines


def report_lines(rows: list[GatedDeltaRow], config: dict[str, Any]) -> list[str]:
    """The run's markdown lines: a head naming the shape and the CPU, then ``summary_table``
    (``config``: the settings as given, with ``T``, ``B``, ``H``, ``D`` and ``repeats``)."""
    head = (f"B{config['B']} T{config['T']} H{config['H']} D{config['D']} float32; CPU "
            f"{machine()['cpu_model']}; torch {torch.__version__}; wall clock, "
            f"{config['repeats']} interleaved rounds, median")
    return [head, "", *summary_table(rows)]


NAME = "gated-delta"
DESCRIPTION = ("Time gated_delta_rule's chunked form (forward, and forward+backward into q, k, "
               "v, beta, g) at each chunk size and its one-token step, next to delta_rule and "
               "transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule "
               "(Qwen3.5's PyTorch fallbacks; rows skipped where transformers is not installed), "
               "in interleaved rounds at each thread count; B, T, H, D float32, k L2-normalised. "
               "Prints the tables; with --out writes its record (results.csv, results.md, "
               "meta.json, lscpu.txt) there.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--T", type=positive_int, default=4096, help="tokens")
    p.add_argument("--B", type=positive_int, default=1, help="batch")
    p.add_argument("--H", type=positive_int, default=8, help="heads")
    p.add_argument("--D", type=positive_int, default=64, help="head dim (Dk = Dv)")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts, run "
                                                    "one after another")
    p.add_argument("--chunk-sizes", default="64,32",
                   help="comma-separated chunk sizes; the first is the ratios' reference")
    p.add_argument("--passes", default=",".join(PASSES),
                   help=f"comma-separated, some of {', '.join(PASSES)}")
    p.add_argument("--repeats", type=positive_int, default=7, help="timed rounds")
    p.add_argument("--step-calls", type=positive_int, default=100,
                   help="one-token calls per timed sample of the step pass")
    add_out_arguments(p)


def report(args: argparse.Namespace, rec: Record | None, rows: list[Any],
           lines: Callable[[list[Any], dict[str, Any]], list[str]]) -> None:
    """Print the run's tables (``lines``: the benchmark's report of its rows and settings)
    and, with a record, write them with the settings (``config``) and the command
    ``fastweights bench NAME ...``."""
    config = recorded_settings(args)
    text = lines(rows, config)
    print("\n".join(text))
    if rec is not None:
        meta = rec.meta(command_line(["fastweights", "bench", rec.name], args), config=config)
        rec.write(rows, meta, markdown=text)


def run(args: argparse.Namespace) -> int:
    threads = parse_int_list("--threads", args.threads)
    chunk_sizes = parse_int_list("--chunk-sizes", args.chunk_sizes)
    passes = parse_name_list("--passes", args.passes, PASSES)
    rec = open_record(args, NAME)
    with user_errors((ValueError,)):
        rows = run_gated_delta(
            T=args.T, B=args.B, H=args.H, D=args.D, threads=tuple(threads),
            chunk_sizes=tuple(chunk_sizes), passes=passes, repeats=args.repeats,
            step_calls=args.step_calls)
    report(args, rec, rows, report_lines)
    return 0
