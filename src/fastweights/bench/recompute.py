"""Training-step time and peak memory with and without gradient checkpointing (recompute).

``fastweights bench recompute`` builds one ``LanguageModel`` per mixer (default: 4
layers, d_model 512, 8 heads, MLP feed-forward, float32, batch 1) and, for every sequence
length, times one training step (forward, loss, backward) with
``model.set_gradient_checkpointing(False)`` and ``(True)``: the median of ``--repeats`` after a
warm-up, and the peak memory the step adds on top of the model and its gradients (CPU: the
resident-set high-water mark, see ``measure.PeakMemory``; CUDA: allocator statistics, on a
separate untimed step). Both settings run in the same process, one after the other, on the same
weights and input; the losses are checked to agree. Results are printed as a table and, with
``--out``, written as a record (bench/record.py: results.csv, results.md, meta.json, lscpu.txt).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .._commands import command_line, parse_int_list, positive_int
from ..models.config import LMConfig
from ..models.lm import LanguageModel
from .measure import PeakMemory, prepare_cpu_memory_accounting, time_call
from .record import Record, add_out_arguments, machine, machine_line
from .targets import check_model_mixers


def _step(model: LanguageModel, ids: torch.Tensor) -> torch.Tensor:
    logits, _ = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach()


def measure(mixer: str, T: int, *, d_model: int, n_layers: int, n_heads: int, repeats: int,
            device: torch.device, memory: bool) -> list[dict[str, Any]]:
    """One row per setting (recompute off, on) for ``mixer`` at length ``T``."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=256, d_model=d_model, n_layers=n_layers,
                                   n_heads=n_heads, mixer=mixer)).to(device).train()
    ids = torch.randint(0, 256, (1, T), device=device)
    rows, losses = [], []
    for recompute in (False, True):
        model.set_gradient_checkpointing(recompute)
        model.zero_grad(set_to_none=False)
        _step(model, ids)  # warm-up; leaves the .grad buffers allocated, as in training
        times = []
        for _ in range(repeats):
            model.zero_grad(set_to_none=False)
            times.append(time_call(lambda: losses.append(_step(model, ids)), device))
        peak = None
        if memory:
            model.zero_grad(set_to_none=False)
            with PeakMemory(device) as pm:
                _step(model, ids)
            peak = pm.peak
        rows.append({"mixer": mixer, "T": T, "recompute": recompute,
                     "ms": 1e3 * statistics.median(times),
                     "peak_mib": None if peak is None else peak / 2**20})
    if not torch.allclose(losses[0], losses[-1], rtol=1e-5, atol=1e-6):
        raise RuntimeError(f"{mixer} T={T}: recompute changed the loss ({losses[0]} vs {losses[-1]})")
    return rows


def _markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# Training step with and without recompute", "",
             f"Command: `{meta['command']}`; {meta['device']}; "
             f"{machine_line(meta['machine'])}", "",
             f"{meta['n_layers']} layers, d_model {meta['d_model']}, {meta['n_heads']} heads, "
             f"batch 1, float32, median of {meta['repeats']} steps; peak = memory one step adds "
             "above the model and its gradients.", "",
             "| mixer | T | step ms | step ms (recompute) | time x | peak MiB | peak MiB (recompute) | memory saved |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    def pk(r: dict[str, Any]) -> str:
        return "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"

    for off, on in zip(rows[::2], rows[1::2]):
        saved = (f"{1 - on['peak_mib'] / off['peak_mib']:.0%}"
                 if off["peak_mib"] and on["peak_mib"] is not None else "n/a")
        lines.append(f"| {off['mixer']} | {off['T']} | {off['ms']:.0f} | {on['ms']:.0f} | "
                     f"{on['ms'] / off['ms']:.2f} | {pk(off)} | {pk(on)} | {saved} |")
    return "\n".join(lines) + "\n"


def run_recompute(mixers: list[str], lengths: list[int], *, d_model: int = 512, n_layers: int = 4,
        n_heads: int = 8, repeats: int = 3, device: torch.device | str = "cpu",
        out: Path | None = None, command: str = "", overwrite: bool = False,
        ) -> list[dict[str, Any]]:
    """``measure`` for every (mixer, T); prints a table row per pair and returns the rows; with
    ``out`` writes the record there (``command`` recorded as given), the folder claimed first
    (refused if it holds anything unless ``overwrite``)."""
    rec = None if out is None else Record(out, NAME, overwrite=overwrite)
    device = torch.device(device)
    memory = device.type == "cuda" or prepare_cpu_memory_accounting()
    rows: list[dict[str, Any]] = []
    for mixer in mixers:
        for T in lengths:
            rows += measure(mixer, T, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                            repeats=repeats, device=device, memory=memory)
            print(_markdown(rows[-2:], {"machine": machine(), "command": "",
                                         "device": str(device), "n_layers": n_layers,
                                         "d_model": d_model, "n_heads": n_heads,
                                         "repeats": repeats}).splitlines()[-1], flush=True)
    if rec is not None:
        meta = rec.meta(command, device=str(device), d_model=d_model, n_layers=n_layers,
                        n_heads=n_heads, repeats=repeats)
        rec.write(rows, meta, markdown=_markdown(rows, meta))
    return rows


NAME = "recompute"
DESCRIPTION = ("Time one training step (forward, loss, backward) of a LanguageModel per mixer "
               "and length with gradient checkpointing off and on, and the peak memory it adds; "
               "checks the losses agree. Prints a table; --out writes its record (results.csv, "
               "results.md, meta.json, lscpu.txt).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mixers", default="delta,linear,softmax", help="comma-separated mixer names")
    p.add_argument("--lengths", default="1024,4096", help="comma-separated T values")
    p.add_argument("--d-model", type=positive_int, default=512)
    p.add_argument("--n-layers", type=positive_int, default=4)
    p.add_argument("--n-heads", type=positive_int, default=8)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_out_arguments(p)


def run(args: argparse.Namespace) -> int:
    mixers = [m for m in args.mixers.split(",") if m]
    check_model_mixers("--mixers", mixers, vocab_size=256, d_model=args.d_model,
                       n_layers=args.n_layers, n_heads=args.n_heads)
    run_recompute(mixers, parse_int_list("--lengths", args.lengths), d_model=args.d_model,
                  n_layers=args.n_layers, n_heads=args.n_heads, repeats=args.repeats,
                  device=args.device, out=args.out,
                  command=command_line(["fastweights", "bench", NAME], args),
                  overwrite=args.overwrite)
    return 0
