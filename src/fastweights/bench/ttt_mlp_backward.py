"""TTT-MLP layer forward+backward with the dual-form scan's hand-written backward pass, against
the same scan differentiated by autograd, and against softmax attention (SDPA), on the CPU.

``python -m fastweights.bench.ttt_mlp_backward`` builds the ``ttt-mlp`` and ``softmax`` mixers
(d_model 512, 8 heads, batch 1, float32, the defaults) and times one forward+backward of each
layer in thread CPU time (``time.thread_time``: on a machine shared with other jobs it counts
only this thread's work), the variants interleaved round by round in this one process, one
warm-up call each, median of ``--repeats``. The "autograd" row runs the plain PyTorch scan
(``ops/ttt/chunk.py``'s ``_ttt_mlp_dual_traced``, the path torch.compile traces) with autograd
doing the backward pass, i.e. TTT-MLP before the hand-written backward; ``--group G`` adds a
row of the hand-written backward with ``checkpoint_group=G`` (autograd's checkpointed scan is
left out: torch.utils.checkpoint keeps its tensors out of sight of the byte count). It also reports the bytes each variant
keeps for the backward pass (tensors saved by autograd, counted once per storage). Run with
``OMP_NUM_THREADS=1`` for the single-thread figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from ..models.registry import build_mixer
from ..ops.ttt import chunk, inner_loop
from .suite import cpu_info


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


def _saved_bytes(step: Callable[[], None]) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of ``step``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m fastweights.bench.ttt_mlp_backward",
                                     description=__doc__)
    parser.add_argument("--lengths", type=str, default="4096", help="comma-separated T values")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group", type=int, default=None,
                        help="also the TTT-MLP rows with checkpoint_group=GROUP")
    parser.add_argument("--json", type=str, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    layers = {"ttt-mlp": build_mixer("ttt-mlp", args.d_model, args.heads),
              "softmax": build_mixer("softmax", args.d_model, args.heads)}
    variants = {"softmax (SDPA)": ("softmax", contextlib.nullcontext),
                "ttt-mlp": ("ttt-mlp", contextlib.nullcontext),
                "ttt-mlp autograd": ("ttt-mlp", _autograd_scan)}
    if args.group is not None:
        grouped = build_mixer("ttt-mlp", args.d_model, args.heads, checkpoint_group=args.group)
        grouped.load_state_dict(layers["ttt-mlp"].state_dict())
        layers[f"ttt-mlp g{args.group}"] = grouped
        variants[f"ttt-mlp g{args.group}"] = (f"ttt-mlp g{args.group}", contextlib.nullcontext)
    cpu = cpu_info()
    print(f"CPU {cpu['model']}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"float32, batch 1, d_model {args.d_model}, {args.heads} heads; thread CPU time, "
          f"median of {args.repeats} after 1 warm-up, variants interleaved")
    results: dict = {"config": {**vars(args), "threads": torch.get_num_threads(),
                                "torch": torch.__version__, "cpu": cpu["model"]}}
    for T in (int(t) for t in args.lengths.split(",")):
        x = torch.randn(1, T, args.d_model, requires_grad=True)
        steps = {name: _step(layers[layer], x, ctx, backward=True)
                 for name, (layer, ctx) in variants.items()}
        saved = {name: _saved_bytes(_step(layers[layer], x, ctx, backward=False))
                 for name, (layer, ctx) in variants.items()}
        times: dict[str, list[float]] = {name: [] for name in steps}
        for step in steps.values():
            step()
        for _ in range(args.repeats):
            for name, step in steps.items():
                start = time.thread_time()
                step()
                times[name].append(time.thread_time() - start)
        row = {name: {"ms": 1e3 * statistics.median(t), "saved_MiB": saved[name] / 2**20}
               for name, t in times.items()}
        base = row["softmax (SDPA)"]["ms"]
        for name, r in row.items():
            print(f"T={T:6d} {name:20s} fwd+bwd {r['ms']:8.0f} ms  ({r['ms'] / base:4.2f}x "
                  f"softmax)  saved for backward {r['saved_MiB']:7.0f} MiB")
        results[str(T)] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
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


if __name__ == "__main__":
    main()
