"""FSDP benchmark: memory per rank and bytes communicated per training step of one language
model, trained by one process, by DDP and by FSDP (``fastweights train --fsdp``'s sharding:
``train.distributed.shard_model``) on N processes (gloo on 127.0.0.1, CPU), for N in
``--world``:

- model state per rank: parameters + gradients + AdamW's two moments, float32, counted from the
  tensors this rank holds (its shards under FSDP): 16 bytes per parameter, divided by N under
  FSDP (exact up to the shards' padding);
- peak resident memory per rank during a step (warm: optimizer state allocated), the largest
  over ranks: the resident set before the step plus what the step adds
  (``bench.measure.PeakMemory``); it includes the Python and torch libraries (a few hundred
  MiB), the activations and FSDP's gathered blocks;
- bytes per rank per step through the collectives: under FSDP measured (the all-gathers'
  gathered buffers and the reduce-scatters' inputs, every call counted); under DDP the
  gradients' bytes, all-reduced once per step (computed: DDP's reducer runs in C++);
- the largest model one rank of ``--memory-gib`` (24) fits: (budget - the rest of the peak) /
  (model-state bytes per parameter), the rest (libraries, activations, gathered blocks) held at
  its measured size: an extrapolation, optimistic where activations grow with the model.

Every rank runs with ``--threads`` threads; on a machine with fewer cores than N x threads the
times measure contention, not FSDP; memory and bytes do not depend on it.

Run: ``fastweights bench fsdp --world 1,2,4 --out benchmarks/results/fsdp_<cpu>``.
Writes its record (bench/record.py): results.csv, results.md (the summary), meta.json (the
command, machine and settings) and lscpu.txt.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .._commands import command_line, parse_int_list, parse_mixer_spec, positive_int, user_errors
from ..models import LanguageModel, LMConfig
from ..train.distributed import device_mesh, shard_model
from .context_parallel import finish_rank, init_rank, run_worlds
from .measure import PeakMemory, resident_bytes, time_call
from .record import Record, Table, add_out_arguments

FIELDS = ["mode", "world", "params", "state_bytes_per_rank", "peak_bytes_per_rank",
          "comm_bytes_per_rank", "comm_measured", "time_s", "largest_params"]
GIB = 2**30


@contextlib.contextmanager
def counting_collectives() -> Iterator[list[int]]:
    """Inside, the bytes of every ``all_gather_single`` (its gathered output) and
    ``reduce_scatter_single`` (its input) are added to the yielded one-item list: the
    collectives FSDP2 runs."""
    total = [0]
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def counted_gather(output: torch.Tensor, *args: Any, **kw: Any) -> Any:
        total[0] += output.numel() * output.element_size()
        return gather(output, *args, **kw)

    def counted_scatter(*args: Any, **kw: Any) -> Any:
        data = kw["input"] if "input" in kw else args[1]
        total[0] += data.numel() * data.element_size()
        return scatter(*args, **kw)

    dist.all_gather_single, dist.reduce_scatter_single = counted_gather, counted_scatter
    try:
        yield total
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter


def _local_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shards of DTensors)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


def _train_step(net: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    logits, _ = net(ids[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _measure(mode: str, world: int, opts: dict) -> tuple[int, int, int | None, int, float]:
    """(parameters, model-state bytes, peak resident bytes or None, collective bytes, seconds)
    of one warm training step of this rank in ``mode`` (single, ddp or fsdp)."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(**opts["model"]))
    params = model.num_parameters()
    net: torch.nn.Module = model
    if mode == "fsdp":
        shard_model(model, device_mesh(world, 1, torch.device("cpu")))
    elif mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (opts["batch"], opts["seq_len"] + 1))
    _train_step(net, opt, ids)  # warm-up: AdamW's moments allocated
    if world > 1:
        dist.barrier()
    seen: dict[str, Any] = {}

    def measured_step() -> None:
        with PeakMemory(torch.device("cpu")) as peak, counting_collectives() as comm:
            seen["before"] = resident_bytes()  # after PeakMemory's malloc_trim: what is held
            _train_step(net, opt, ids)
        seen["peak"], seen["moved"] = peak.peak, comm[0]
        if world > 1:
            dist.barrier()

    elapsed = time_call(measured_step, torch.device("cpu"))
    held = _local_bytes(model)
    moved = seen["moved"] if mode == "fsdp" else held if mode == "ddp" else 0
    return (params, 4 * held,  # parameters, gradients and two moments: the same shapes
            None if seen["peak"] is None else seen["before"] + seen["peak"], moved, elapsed)


def _rank_main(rank: int, world: int, port: int, opts: dict, path: str) -> None:
    init_rank(rank, world, port, opts)
    rows = []
    for mode in (["single"] if world == 1 else opts["modes"]):
        every = [_measure(mode, world, opts)]
        if world > 1:
            mine, every = every[0], [None] * world
            dist.all_gather_object(every, mine)
        if rank == 0:
            peaks = [e[2] for e in every]
            row = {"mode": mode, "world": world, "params": every[0][0],
                   "state_bytes_per_rank": max(e[1] for e in every),
                   "peak_bytes_per_rank": None if None in peaks else max(peaks),
                   "comm_bytes_per_rank": max(e[3] for e in every),
                   "comm_measured": mode == "fsdp", "time_s": max(e[4] for e in every)}
            row["largest_params"] = largest_params(row, opts["memory_gib"] * GIB)
            rows.append(row)
    finish_rank(rank, world, rows, path)


def largest_params(row: dict, budget: float) -> int | None:
    """The parameters one rank of ``budget`` bytes fits at ``row``'s model-state bytes per
    parameter, the rest of its peak (libraries, activations, gathered blocks) held fixed; None
    when the peak was not measured."""
    peak, state = row["peak_bytes_per_rank"], row["state_bytes_per_rank"]
    if peak is None:
        return None
    return max(0, int((budget - (peak - state)) / (state / row["params"])))


def _summary(rows: list[dict], budget_gib: float) -> str:
    lines = ["| mode | N | params (M) | model state/rank (MiB) | peak/rank (MiB) | "
             f"comm/rank/step (MiB) | time/step (s) | largest model in {budget_gib:g} GiB/rank (M params) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "-" if r["peak_bytes_per_rank"] is None else f"{r['peak_bytes_per_rank'] / 2**20:.0f}"
        comm = ("-" if r["mode"] == "single" else f"{r['comm_bytes_per_rank'] / 2**20:.1f}"
                + ("" if r["comm_measured"] else " (computed)"))
        largest = "-" if r["largest_params"] is None else f"{r['largest_params'] / 1e6:.0f}"
        lines.append(f"| {r['mode']} | {r['world']} | {r['params'] / 1e6:.1f} | "
                     f"{r['state_bytes_per_rank'] / 2**20:.0f} | {peak} | {comm} | "
                     f"{r['time_s']:.2f} | {largest} |")
    return "\n".join(lines) + "\n"


def run_fsdp(worlds: list[int], out: Path, *, model: dict[str, Any], batch: int = 1,
        seq_len: int = 64, threads: int = 1, memory_gib: float = 24.0, timeout: float = 600.0,
        command: str = "", overwrite: bool = False) -> list[dict]:
    """Measure one process (N = 1) and DDP and FSDP on every N > 1 of ``worlds`` for the
    model ``LMConfig(**model)``; writes the record (results.csv, results.md, meta.json with
    ``command``, lscpu.txt) into ``out``, claimed first (refused if it holds anything unless
    ``overwrite``), prints the summary, returns the rows."""
    LMConfig(**model)  # a bad model setting fails here, before any process starts
    rec = Record(out, NAME, overwrite=overwrite)
    opts = {"model": model, "batch": batch, "seq_len": seq_len, "threads": threads,
            "timeout": timeout, "memory_gib": memory_gib, "modes": ["ddp", "fsdp"]}
    # one group of processes per mode, so that no mode runs in a heap another one has grown
    rows = run_worlds(_rank_main, [w for w in worlds if w == 1], opts)
    for mode in opts["modes"]:
        rows += run_worlds(_rank_main, [w for w in worlds if w > 1], {**opts, "modes": [mode]})
    rows.sort(key=lambda r: (r["world"], r["mode"]))
    summary = _summary(rows, memory_gib)
    rec.write(Table(rows, FIELDS), rec.meta(
        command, threads_per_rank=threads, model=model, batch=batch, seq_len=seq_len,
        worlds=worlds, memory_gib=memory_gib, timeout=timeout), markdown=summary)
    print(summary)
    return rows


NAME = "fsdp"
DESCRIPTION = ("One language model's training step (AdamW) on one process, and under DDP and "
               "FSDP (fastweights train --fsdp) on N processes (gloo, CPU) for N in --world: "
               "model state (parameters, gradients, AdamW moments) and peak resident memory per "
               "rank, bytes through the collectives per rank and step, and the largest model "
               "one rank of --memory-gib fits (extrapolated). Writes its record (results.csv, "
               "results.md, meta.json, lscpu.txt) into --out.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", default="1,2,4", help="comma-separated process counts N")
    p.add_argument("--mixer", default="delta", help="the mixer of every layer (name or name:opt=value)")
    p.add_argument("--d-model", type=positive_int, default=768)
    p.add_argument("--n-layers", type=positive_int, default=14)
    p.add_argument("--n-heads", type=positive_int, default=12)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    p.add_argument("--memory-gib", type=float, default=24.0,
                   help="memory of one rank, for the largest model")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    add_out_arguments(p, required=True)


def run(args: argparse.Namespace) -> int:
    worlds = parse_int_list("--world", args.world)
    name, options = parse_mixer_spec("--mixer", args.mixer)
    model = {"d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads,
             "mixer": name, "mixer_options": options}
    with user_errors((TypeError, ValueError)):
        run_fsdp(worlds, args.out, model=model, batch=args.batch, seq_len=args.seq_len,
                 threads=args.threads, memory_gib=args.memory_gib, timeout=args.timeout,
                 command=command_line(["fastweights", "bench", NAME], args),
                 overwrite=args.overwrite)
    return 0
