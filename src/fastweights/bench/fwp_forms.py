"""CPU/GPU time of the fast-weight op forms (chunk vs recurrent vs naive) in one process.

``fastweights bench fwp-forms [--T 4096] [--chunk-sizes 32,64,128]`` (or ``python -m
fastweights.bench.fwp_forms``, the same command) times the forward
of ``linear_attn`` and ``delta_rule`` at B1 H8 D64 (float32 by default) in every mode, the
chunked form at each chunk size, and prints them next to the machine's measured square-matmul
rate and the FLOP rate each form achieves (counted as in ``fastweights.bench.measure``).
``--clock cpu`` times with the process's CPU time (all threads) instead of the wall clock: on a
machine shared with other work it counts the work done, not the time spent waiting for a core.
The calls are timed interleaved (one call of each form per round, ``--repeats`` rounds after one
warm-up round), so that every form sees the same machine state; the median counts.

``--autocast-bf16`` adds, next to each chunked row, the same call under
``torch.autocast("cpu", dtype=torch.bfloat16)`` with ``FASTWEIGHTS_CPU_BF16=on``: the CPU
bfloat16 product path (ops/_autocast.py) whatever the CPU, with its largest difference from the
float32 row's output (relative to that output's largest magnitude; "% of matmul" stays the
share of the float32 matmul rate). The header then gives the CPU model, torch's vector
capability (``torch.backends.cpu.get_cpu_capability()``), whether the CPU has AMX-BF16 /
AVX512-BF16 (what ``auto`` decides by) and the bfloat16 matmul rate:
``fastweights bench fwp-forms --modes chunk --autocast-bf16``.

``--profile`` adds, under each form's line, where its time goes: the ``torch.profiler`` table
of the ``--profile-top`` operators with the most self CPU time per call (calls, ms, share of
the operators' total), and the wall time of a profiled call not spent in any operator (Python,
dispatch); see ``profile_table``.

Dimension legend: B batch, T time, H heads, D head dim.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._commands import parse_int_list, positive_int
from ..ops import delta_rule, elu_plus_one, linear_attn, sum_norm
from ..ops._autocast import CPU_BF16_ENV, cpu_has_fast_bf16
from .measure import count_flops, matmul_gflops, time_call
from .record import machine

BF16_TAG = " autocast-bf16"  # suffix of the rows that take the CPU bfloat16 product path


def _timer(clock: str) -> Callable[[Callable[[], Any]], float]:
    """Seconds of one call on the CPU, ``clock`` "cpu" (process CPU time) or "wall"."""
    return functools.partial(time_call, device=torch.device("cpu"),
                             clock="process" if clock == "cpu" else "wall")


def _inputs(B: int, T: int, H: int, D: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=g, dtype=dtype) for _ in range(3))
    return {"q": elu_plus_one(q), "k": elu_plus_one(k), "v": v,
            "qn": sum_norm(elu_plus_one(q)), "kn": sum_norm(elu_plus_one(k)),
            "beta": torch.rand(B, T, H, generator=g, dtype=dtype)}


def profile_table(call: Callable[[], Any], repeats: int, top: int) -> str:
    """Where ``call``'s time goes: one warm-up call, then ``repeats`` calls under the CPU
    profiler. Returns the table of the ``top`` ATen operators by self CPU time (time in the
    operator itself, not in the operators it calls), per call: calls, milliseconds and share of
    the summed self time of every operator; then that total, the profiled wall time per call
    and their difference, the time outside any operator (Python, dispatch, profiler)."""
    call()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wall = time_call(lambda: [call() for _ in range(repeats)], torch.device("cpu")) / repeats
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in ops) / repeats / 1e3  # ms per call
    ops.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    lines = [f"  {'operator':<44} {'calls':>7} {'self ms':>9} {'share':>7}"]
    for e in ops[:top]:
        ms = e.self_cpu_time_total / repeats / 1e3
        lines.append(f"  {e.key:<44} {e.count / repeats:>7.0f} {ms:>9.2f} "
                     f"{100 * ms / total if total else 0.0:>6.1f}%")
    rest = ops[top:]
    if rest:
        ms = sum(e.self_cpu_time_total for e in rest) / repeats / 1e3
        lines.append(f"  {f'({len(rest)} other operators)':<44} "
                     f"{sum(e.count for e in rest) / repeats:>7.0f} {ms:>9.2f} "
                     f"{100 * ms / total if total else 0.0:>6.1f}%")
    lines.append(f"  {'all operators (self CPU)':<44} {sum(e.count for e in ops) / repeats:>7.0f} "
                 f"{total:>9.2f}  100.0%")
    lines.append(f"  profiled wall time {wall * 1e3:.2f} ms per call, "
                 f"{max(wall * 1e3 - total, 0.0):.2f} ms of it outside the operators")
    return "\n".join(lines)


def _pass(backward: bool, call: Callable[[], Any]) -> Callable[[], Any]:
    """The forward ``call`` or, with ``backward``, forward plus the backward of sum(o)."""
    if not backward:
        return call
    return lambda: call()[0].sum().backward()


def _autocast_bf16(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` under CPU bfloat16 autocast (with FASTWEIGHTS_CPU_BF16=on: the product path)."""
    def run() -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return call()

    return run


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """The environment variable ``name`` set to ``value`` for the block, then restored."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _bf16_header() -> str:
    caps = getattr(torch.cpu, "get_capabilities", lambda: {})()
    flags = [f for f in ("amx_bf16", "avx512_bf16", "avx512_f", "avx2") if caps.get(f)]
    peak, n = matmul_gflops(torch.device("cpu"), torch.bfloat16, sizes=(256, 512))
    return (f"CPU {machine()['cpu_model']}; torch CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}; flags {','.join(flags) or 'none'}; "
            f"fast bfloat16 (AMX-BF16/AVX512-BF16): {'yes' if cpu_has_fast_bf16() else 'no'} "
            f"({CPU_BF16_ENV}=auto takes the {'bfloat16' if cpu_has_fast_bf16() else 'float32'} "
            f"path); bfloat16 matmul {peak:.1f} GFLOP/s (n={n}); rows{BF16_TAG}: "
            f"{CPU_BF16_ENV}=on under torch.autocast('cpu', dtype=torch.bfloat16)")


def run_fwp_forms(*, B: int = 1, T: int = 4096, H: int = 8, D: int = 64, dtype: str = "float32",
        repeats: int = 5, chunk_sizes: tuple[int, ...] = (64,),
        modes: tuple[str, ...] = ("chunk", "recurrent", "naive"), clock: str = "wall",
        backward: bool = False, autocast_bf16: bool = False, profile: bool = False,
        profile_top: int = 12) -> list[dict[str, Any]]:
    """Time every form (module docstring); prints a line per form (and with ``profile`` its
    operator table) and returns the rows: form, median and min ms, GFLOP/s."""
    with _env(CPU_BF16_ENV, "on") if autocast_bf16 else contextlib.nullcontext():
        return _run(B, T, H, D, getattr(torch, dtype), repeats, chunk_sizes, modes, clock,
                    backward, autocast_bf16, profile, profile_top)


def _run(B: int, T: int, H: int, D: int, dtype: torch.dtype, repeats: int,
         chunk_sizes: tuple[int, ...], modes: tuple[str, ...], clock: str, backward: bool,
         autocast_bf16: bool, profile: bool, profile_top: int) -> list[dict[str, Any]]:
    device = torch.device("cpu")
    x = _inputs(B, T, H, D, dtype)
    if backward:
        x = {n: t.requires_grad_() for n, t in x.items()}
    peak, n = matmul_gflops(device, dtype)
    timed = _timer(clock)
    print(f"B{B} H{H} T{T} D{D} {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}, {clock} clock; "
          f"matmul {peak:.1f} GFLOP/s (n={n}, wall clock); "
          f"{'forward+backward' if backward else 'forward'}")
    if autocast_bf16:
        print(_bf16_header())
    calls = {}
    for mode in modes:
        for C in (chunk_sizes if mode == "chunk" else [64]):
            tag = f"[chunk C={C}]" if mode == "chunk" else f"[{mode}]"
            calls[f"linear_attn{tag}"] = _pass(backward, lambda m=mode, c=C: linear_attn(
                x["q"], x["k"], x["v"], normalize=True, mode=m, chunk_size=c))
            calls[f"delta_rule{tag}"] = _pass(backward, lambda m=mode, c=C: delta_rule(
                x["qn"], x["kn"], x["v"], x["beta"], mode=m, chunk_size=c))
            if autocast_bf16 and mode == "chunk":
                for op in ("linear_attn", "delta_rule"):
                    calls[f"{op}{tag}{BF16_TAG}"] = _autocast_bf16(calls[f"{op}{tag}"])
    names = sorted(calls)
    rows = []
    with torch.enable_grad() if backward else torch.no_grad():
        notes = {}
        for name in names:  # the warm-up round; the bfloat16 rows' difference from float32
            out = calls[name]()
            if name.endswith(BF16_TAG) and not backward:
                ref = calls[name.removesuffix(BF16_TAG)]()[0]
                err = (out[0] - ref).abs().max() / ref.abs().max()
                notes[name] = f"  max|o - o_float32| / max|o_float32| = {err.item():.1e}"
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(repeats):
            for name in names:
                times[name].append(timed(calls[name]))
        for name in names:
            flops = count_flops(calls[name])
            t = statistics.median(times[name])
            rate = flops / t / 1e9
            # A CPU-clock rate is per CPU-second, not comparable with the wall-clock matmul rate.
            share = f"({100 * rate / peak:5.1f}% of matmul)" if clock == "wall" else "per CPU-s"
            print(f"{name:<44} {t * 1e3:9.2f} ms  {rate:7.2f} GFLOP/s {share}  "
                  f"min {min(times[name]) * 1e3:.2f} ms{notes.get(name, '')}", flush=True)
            rows.append({"form": name, "ms": t * 1e3, "min_ms": min(times[name]) * 1e3,
                         "gflop_s": rate})
            if profile:
                print(profile_table(calls[name], repeats, profile_top), flush=True)
    return rows


NAME = "fwp-forms"
DESCRIPTION = ("Time linear_attn and delta_rule in every mode, the chunked form at each chunk "
               "size, interleaved, next to the measured matmul rate and each form's GFLOP/s.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--B", type=positive_int, default=1)
    p.add_argument("--T", type=positive_int, default=4096)
    p.add_argument("--H", type=positive_int, default=8)
    p.add_argument("--D", type=positive_int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--chunk-sizes", default="64", help="comma-separated chunk sizes")
    p.add_argument("--modes", default="chunk,recurrent,naive")
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"))
    p.add_argument("--backward", action="store_true",
                   help="time forward+backward (gradients of q, k, v, beta) instead of forward")
    p.add_argument("--autocast-bf16", action="store_true",
                   help="add each chunked form under CPU bfloat16 autocast with "
                        f"{CPU_BF16_ENV}=on (the bfloat16 product path), interleaved with it")
    p.add_argument("--profile", action="store_true",
                   help="under each form, the profiler's table of its operators by self CPU "
                        "time (per call, share of the total)")
    p.add_argument("--profile-top", type=positive_int, default=12,
                   help="operators listed by --profile (the rest summed in one line)")


def run(args: argparse.Namespace) -> int:
    run_fwp_forms(B=args.B, T=args.T, H=args.H, D=args.D, dtype=args.dtype,
                  repeats=args.repeats, chunk_sizes=parse_int_list("--chunk-sizes", args.chunk_sizes),
                  modes=[m for m in args.modes.split(",") if m], clock=args.clock,
                  backward=args.backward, autocast_bf16=args.autocast_bf16, profile=args.profile,
                  profile_top=args.profile_top)
    return 0
