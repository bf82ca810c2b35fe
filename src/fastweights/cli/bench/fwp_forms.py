"""``fastweights bench fwp-forms``: time of the fast-weight op forms (chunk vs recurrent vs
naive) in one process (``fastweights.bench.fwp_forms``)."""

from __future__ import annotations

import argparse

from ...bench import fwp_forms
from ...ops._autocast import CPU_BF16_ENV
from ..common import parse_int_list, positive_int

NAME = "fwp-forms"
HELP = "time of the fast-weight op forms (chunk, recurrent, naive)"
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
    fwp_forms.run(B=args.B, T=args.T, H=args.H, D=args.D, dtype=args.dtype,
                  repeats=args.repeats, chunk_sizes=parse_int_list("--chunk-sizes", args.chunk_sizes),
                  modes=[m for m in args.modes.split(",") if m], clock=args.clock,
                  backward=args.backward, autocast_bf16=args.autocast_bf16, profile=args.profile,
                  profile_top=args.profile_top)
    return 0
