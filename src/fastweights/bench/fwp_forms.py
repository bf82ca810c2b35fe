"""CPU/GPU time of the fast-weight op forms (chunk vs recurrent vs naive) in one process.

``python -m fastweights.bench.fwp_forms [--T 4096] [--chunk-sizes 32,64,128]`` times the forward
of ``linear_attn`` and ``delta_rule`` at B1 H8 D64 (float32 by default) in every mode, the
chunked form at each chunk size, and prints them next to the machine's measured square-matmul
rate and the FLOP rate each form achieves (counted as in ``fastweights.bench.measure``).
``--clock cpu`` times with the process's CPU time (all threads) instead of the wall clock: on a
machine shared with other work it counts the work done, not the time spent waiting for a core.

Dimension legend: B batch, T time, H heads, D head dim.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..ops import delta_rule, elu_plus_one, linear_attn, sum_norm
from .measure import count_flops, matmul_gflops


def _timer(clock: str) -> Callable[[Callable[[], Any]], float]:
    now = time.process_time if clock == "cpu" else time.perf_counter

    def timed(fn: Callable[[], Any]) -> float:
        start = now()
        fn()
        return now() - start

    return timed


def _inputs(B: int, T: int, H: int, D: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=g, dtype=dtype) for _ in range(3))
    return {"q": elu_plus_one(q), "k": elu_plus_one(k), "v": v,
            "qn": sum_norm(elu_plus_one(q)), "kn": sum_norm(elu_plus_one(k)),
            "beta": torch.rand(B, T, H, generator=g, dtype=dtype)}


def _pass(backward: bool, call: Callable[[], Any]) -> Callable[[], Any]:
    """The forward ``call`` or, with ``backward``, forward plus the backward of sum(o)."""
    if not backward:
        return call
    return lambda: call()[0].sum().backward()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk-sizes", default="64", help="comma-separated chunk sizes")
    p.add_argument("--modes", default="chunk,recurrent,naive")
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"))
    p.add_argument("--backward", action="store_true",
                   help="time forward+backward (gradients of q, k, v, beta) instead of forward")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cpu")
    x = _inputs(args.B, args.T, args.H, args.D, dtype)
    if args.backward:
        x = {n: t.requires_grad_() for n, t in x.items()}
    peak, n = matmul_gflops(device, dtype)
    timed = _timer(args.clock)
    print(f"B{args.B} H{args.H} T{args.T} D{args.D} {args.dtype}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}, {args.clock} clock; "
          f"matmul {peak:.1f} GFLOP/s (n={n}, wall clock); "
          f"{'forward+backward' if args.backward else 'forward'}")
    calls = {}
    for mode in args.modes.split(","):
        sizes = [int(c) for c in args.chunk_sizes.split(",")] if mode == "chunk" else [64]
        for C in sizes:
            tag = f"[chunk C={C}]" if mode == "chunk" else f"[{mode}]"
            calls[f"linear_attn{tag}"] = _pass(args.backward, lambda m=mode, c=C: linear_attn(
                x["q"], x["k"], x["v"], normalize=True, mode=m, chunk_size=c))
            calls[f"delta_rule{tag}"] = _pass(args.backward, lambda m=mode, c=C: delta_rule(
                x["qn"], x["kn"], x["v"], x["beta"], mode=m, chunk_size=c))
    with torch.enable_grad() if args.backward else torch.no_grad():
        for name, call in sorted(calls.items()):
            timed(call)
            times = [timed(call) for _ in range(args.repeats)]
            flops = count_flops(call)
            t = statistics.median(times)
            rate = flops / t / 1e9
            # A CPU-clock rate is per CPU-second, not comparable with the wall-clock matmul rate.
            share = f"({100 * rate / peak:5.1f}% of matmul)" if args.clock == "wall" else "per CPU-s"
            print(f"{name:<30} {t * 1e3:9.2f} ms  {rate:7.2f} GFLOP/s {share}  "
                  f"min {min(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
