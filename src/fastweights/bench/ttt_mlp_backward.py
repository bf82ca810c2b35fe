"""TTT-MLP layer forward+backward with the dual-form scan's hand-written backward pass, against
the same scan differentiated by autograd, and against softmax attention (SDPA), on the CPU.

``fastweights bench ttt-mlp-backward`` builds the ``ttt-mlp`` and ``softmax`` mixers (d_model 512, 8
heads, batch 1, float32, the defaults) and times one forward+backward of each layer in thread CPU
time (bench/measure.py's ``time_call`` on its ``thread`` clock: on a machine shared with other jobs
it counts only this thread's work), the variants interleaved round by round in this one process, one
warm-up call each, median of ``--repeats``. The "autograd" row runs the plain PyTorch scan
(``ops/ttt/chunk.py``'s ``_ttt_mlp_dual_traced``, the path torch.compile traces) with autograd doing
the backward pass, i.e. TTT-MLP before the hand-written backward; ``--group G`` adds a row of the
hand-written backward with ``checkpoint_group=G`` (autograd's checkpointed scan is left out:
torch.utils.checkpoint keeps its tensors out of sight of the byte count). It also reports the bytes
each variant keeps for the backward pass (bench/measure.py ``saved_bytes``: tensors saved by
autograd, counted once per storage). Run with ``OMP_NUM_THREADS=1`` for the single-thread
figures.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable, Iterator

import torch

from .._commands import command_line, parse_int_list, positive_int
from ..models.registry import build_mixer
from ..ops.ttt import chunk, inner_loop
from .measure import saved_bytes, time_call
from .record import add_out_arguments, machine, open_record


@contextlib.contextmanager
def _autograd_scan() -> Iterator[None]:
    """ttt_mlp's dual mode runs the plain scan (autograd backward) inside this block."""
    kernels = inner_loop._KERNELS["mlp"]
    saved = kernels["dual"]
    kernels["dual"] = chunk._ttt_mlp_dual_traced
    try:
        yield
    finally:
        kernels["dual"] = saved


def run_ttt_mlp_backward(lengths: list[int], *, d_model: int = 512, heads: int = 8, repeats: int = 5,
        group: int | None = None) -> dict:
    """Every variant at every length (module docstring); prints a row per variant and returns
    the results: ``config`` and, per length (as a string), each variant's ms and saved MiB."""
    torch.manual_seed(0)
    layers = {"ttt-mlp": build_mixer("ttt-mlp", d_model, heads),
              "softmax": build_mixer("softmax", d_model, heads)}
    variants = {"softmax (SDPA)": ("softmax", contextlib.nullcontext),
                "ttt-mlp": ("ttt-mlp", contextlib.nullcontext),
                "ttt-mlp autograd": ("ttt-mlp", _autograd_scan)}
    if group is not None:
        grouped = build_mixer("ttt-mlp", d_model, heads, checkpoint_group=group)
        grouped.load_state_dict(layers["ttt-mlp"].state_dict())
        layers[f"ttt-mlp g{group}"] = grouped
        variants[f"ttt-mlp g{group}"] = (f"ttt-mlp g{group}", contextlib.nullcontext)
    cpu = machine()["cpu_model"]
    print(f"CPU {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"float32, batch 1, d_model {d_model}, {heads} heads; thread CPU time, "
          f"median of {repeats} after 1 warm-up, variants interleaved")
    config = {"lengths": ",".join(map(str, lengths)), "d_model": d_model, "heads": heads,
              "repeats": repeats, "group": group}
    results: dict = {"config": {**config, "threads": torch.get_num_threads(),
                                "torch": torch.__version__, "cpu": cpu}}
    for T in lengths:
        x = torch.randn(1, T, d_model, requires_grad=True)
        steps = {name: _step(layers[layer], x, ctx, backward=True)
                 for name, (layer, ctx) in variants.items()}
        saved = {name: saved_bytes(_step(layers[layer], x, ctx, backward=False))
                 for name, (layer, ctx) in variants.items()}
        times: dict[str, list[float]] = {name: [] for name in steps}
        for step in steps.values():
            step()
        for _ in range(repeats):
            for name, step in steps.items():
                times[name].append(time_call(step, torch.device("cpu"), clock="thread"))
        row = {name: {"ms": 1e3 * statistics.median(t), "saved_MiB": saved[name] / 2**20}
               for name, t in times.items()}
        base = row["softmax (SDPA)"]["ms"]
        for name, r in row.items():
            print(f"T={T:6d} {name:20s} fwd+bwd {r['ms']:8.0f} ms  ({r['ms'] / base:4.2f}x "
                  f"softmax)  saved for backward {r['saved_MiB']:7.0f} MiB")
        results[str(T)] = row
    return results


def _step(layer: torch.nn.Module, x: torch.Tensor, ctx: Callable, backward: bool
          ) -> Callable[[], None]:
    """One forward (and backward) pass of ``layer`` on x inside ``ctx()``."""
    def step() -> None:
        with ctx():
            y, _ = layer(x)
            if backward:
                y.sum().backward()
    return step


NAME = "ttt-mlp-backward"
DESCRIPTION = ("Time one forward+backward of the ttt-mlp and softmax layers in thread CPU time, "
               "variants interleaved, and the bytes each keeps for the backward pass. Run with "
               "OMP_NUM_THREADS=1 for single-thread figures; --out writes its record "
               "(results.csv, results.md, meta.json, lscpu.txt).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="4096", help="comma-separated T values")
    p.add_argument("--d-model", type=positive_int, default=512)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--group", type=positive_int, default=None,
                   help="also the TTT-MLP rows with checkpoint_group=GROUP")
    add_out_arguments(p)


def run(args: argparse.Namespace) -> int:
    lengths = parse_int_list("--lengths", args.lengths)
    rec = open_record(args, NAME)
    results = run_ttt_mlp_backward(lengths, d_model=args.d_model, heads=args.heads,
                                   repeats=args.repeats, group=args.group)
    if rec is not None:
        rows = [{"T": int(T), "variant": name, "ms": r["ms"], "saved_MiB": r["saved_MiB"]}
                for T, by in results.items() if T != "config" for name, r in by.items()]
        lines = ["| T | variant | fwd+bwd ms (thread CPU time) | / softmax | saved for backward "
                 "MiB |", "|---:|---|---:|---:|---:|"]
        for r in rows:
            base = results[str(r["T"])]["softmax (SDPA)"]["ms"]
            lines.append(f"| {r['T']} | {r['variant']} | {r['ms']:.4g} | {r['ms'] / base:.2f} | "
                         f"{r['saved_MiB']:.4g} |")
        rec.write(rows, rec.meta(command_line(["fastweights", "bench", NAME], args),
                                 config=results["config"]), markdown=lines)
    return 0
