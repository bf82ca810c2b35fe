"""CPU time of the TTT dual form against the vectorised primal form (docs/maths.md 2.4, 2.9 (a)).

``fastweights bench ttt-modes`` times ``ttt_linear`` and ``ttt_mlp`` in both modes at
B1 H4 T2048 d64, mini-batch 16, float32 (the defaults), forward alone and forward + backward, all
in this one process: one warm-up call per case, then the median of ``--repeats`` calls. It also
reports the float64 max disagreement between the two modes on a shorter sequence. Prints a table;
``--out DIR`` writes its record (bench/record.py). On a machine shared with other jobs, run it with
``OMP_WAIT_POLICY=passive``: spinning OpenMP workers that lose their core turn every small op of
the dual form's sequential loop into a wait for the scheduler.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from .._commands import command_line, positive_int
from ..ops import ttt_linear, ttt_mlp
from .measure import time_call
from .record import add_out_arguments, open_record

OPS: dict[str, Callable] = {"ttt_linear": ttt_linear, "ttt_mlp": ttt_mlp}


def make_inputs(
    kind: str, B: int, T: int, H: int, d: int, dtype: torch.dtype, seed: int = 0,
) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
    """Random q, k, v [B, T, H, d], eta [B, T, H], inner weights (batch 1) and LayerNorm [H, d],
    scaled as the layer's initialisation would give them (docs/maths.md 2.6)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)

    if kind == "ttt_linear":
        state = (rnd(1, H, d, d, std=0.02), torch.zeros(1, H, d, dtype=dtype))
    else:
        state = (rnd(1, H, d, 4 * d, std=0.02), torch.zeros(1, H, 4 * d, dtype=dtype),
                 rnd(1, H, 4 * d, d, std=0.02), torch.zeros(1, H, d, dtype=dtype))
    return {
        "q": rnd(B, T, H, d), "k": rnd(B, T, H, d), "v": rnd(B, T, H, d),
        "eta": torch.full((B, T, H), 0.5 / d, dtype=dtype),  # eta_base sigmoid(0) / d
        "initial_state": state, "ln_weight": torch.ones(H, d, dtype=dtype),
        "ln_bias": torch.zeros(H, d, dtype=dtype),
    }


def _leaves(inputs: dict) -> list[torch.Tensor]:
    return [inputs[n] for n in ("q", "k", "v", "eta", "ln_weight", "ln_bias")] + [
        w for w in inputs["initial_state"] if w is not None]


def time_mode(
    kind: str, mode: str, inputs: dict, mini_batch_size: int, backward: bool, repeats: int,
) -> float:
    """Median seconds of one forward (and backward) call, after one warm-up call."""
    op = OPS[kind]
    for x in _leaves(inputs):
        x.requires_grad_(backward)

    def call() -> None:
        o, _ = op(inputs["q"], inputs["k"], inputs["v"], inputs["eta"],
                  initial_state=inputs["initial_state"], ln_weight=inputs["ln_weight"],
                  ln_bias=inputs["ln_bias"], residual=True, mini_batch_size=mini_batch_size,
                  mode=mode)
        if backward:
            o.sum().backward()

    call()
    times = []
    for _ in range(repeats):
        for x in _leaves(inputs):
            x.grad = None
        times.append(time_call(call, torch.device("cpu")))
    return statistics.median(times)


def max_disagreement(kind: str, B: int, T: int, H: int, d: int, mini_batch_size: int) -> float:
    """float64 max |dual - primal| of the outputs."""
    inputs = make_inputs(kind, B, T, H, d, torch.float64, seed=1)
    outs = [
        OPS[kind](inputs["q"], inputs["k"], inputs["v"], inputs["eta"],
                  initial_state=inputs["initial_state"], ln_weight=inputs["ln_weight"],
                  ln_bias=inputs["ln_bias"], residual=True, mini_batch_size=mini_batch_size,
                  mode=mode)[0]
        for mode in ("dual", "primal")
    ]
    return (outs[0] - outs[1]).abs().max().item()


def run_ttt_modes(ops: list[str], *, batch: int = 1, heads: int = 4, seq_len: int = 2048,
        head_dim: int = 64, mini_batch_size: int = 16, repeats: int = 5) -> dict:
    """Both modes of every op in ``ops`` (``OPS``), forward and forward + backward, and their
    float64 disagreement at T = 256; prints the table and returns the results (``config`` and
    one entry per op)."""
    B, T, H, d, b = batch, seq_len, heads, head_dim, mini_batch_size
    print(f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}, float32, "
          f"B{B} H{H} T{T} d{d} mini-batch {b}, median of {repeats} after 1 warm-up")
    results: dict = {"config": {"B": B, "T": T, "H": H, "d": d, "mini_batch_size": b,
                                "threads": torch.get_num_threads(), "torch": torch.__version__}}
    for kind in ops:
        inputs = make_inputs(kind, B, T, H, d, torch.float32)
        row: dict = {}
        for what, backward in (("forward", False), ("forward+backward", True)):
            secs = {m: time_mode(kind, m, inputs, b, backward, repeats) for m in ("dual", "primal")}
            row[what] = {**secs, "speedup": secs["primal"] / secs["dual"]}
            print(f"{kind:10s} {what:17s} dual {1e3 * secs['dual']:8.1f} ms   primal "
                  f"{1e3 * secs['primal']:8.1f} ms   primal/dual {row[what]['speedup']:5.2f}x")
        row["float64_max_abs_dual_minus_primal_T256"] = max_disagreement(kind, B, 256, H, d, b)
        print(f"{kind:10s} float64 max |dual - primal| (T=256): "
              f"{row['float64_max_abs_dual_minus_primal_T256']:.2e}")
        results[kind] = row
    return results


NAME = "ttt-modes"
DESCRIPTION = ("Time ttt_linear and ttt_mlp in both modes, forward alone and forward + backward "
               "(median of --repeats after a warm-up), and their float64 disagreement on a "
               "shorter sequence. Prints a table; --out writes its record (results.csv, "
               "results.md, meta.json, lscpu.txt). On a shared machine run it with "
               "OMP_WAIT_POLICY=passive.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--seq-len", type=positive_int, default=2048)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--mini-batch-size", type=positive_int, default=16)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: torch's)")
    p.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS))
    add_out_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rec = open_record(args, NAME)
    results = run_ttt_modes(args.ops, batch=args.batch, heads=args.heads, seq_len=args.seq_len,
                            head_dim=args.head_dim, mini_batch_size=args.mini_batch_size,
                            repeats=args.repeats)
    if rec is not None:
        rows = [{"op": kind, "pass": what, "dual_s": row[what]["dual"],
                 "primal_s": row[what]["primal"], "primal_over_dual": row[what]["speedup"],
                 "float64_max_abs_dual_minus_primal_T256":
                     row["float64_max_abs_dual_minus_primal_T256"]}
                for kind, row in results.items() if kind != "config"
                for what in ("forward", "forward+backward")]
        lines = ["| op | pass | dual ms | primal ms | primal / dual | float64 max |dual - "
                 "primal| (T=256) |", "|---|---|---:|---:|---:|---:|"]
        lines += [f"| {r['op']} | {r['pass']} | {1e3 * r['dual_s']:.4g} | "
                  f"{1e3 * r['primal_s']:.4g} | {r['primal_over_dual']:.2f} | "
                  f"{r['float64_max_abs_dual_minus_primal_T256']:.2e} |" for r in rows]
        rec.write(rows, rec.meta(command_line(["fastweights", "bench", NAME], args),
                                 config=results["config"]), markdown=lines)
    return 0
