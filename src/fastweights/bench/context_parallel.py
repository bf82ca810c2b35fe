"""Context-parallel benchmark: one layer's training step (forward + backward) on one sequence of
T tokens split over N processes (gloo on 127.0.0.1, CPU), for N in ``--world`` and T in
``--lengths``:

- time per step: wall time of the slowest rank, median of ``--repeats`` after one warm-up;
- peak memory per rank: the largest over ranks of what the step adds to the resident set
  (``bench.measure.PeakMemory``, same method as ``fastweights bench``);
- bytes communicated per layer per step, counted by the collectives themselves
  (``parallel.comm.TRAFFIC``: tensor payloads sent, forward and backward, summed over ranks;
  the small pickled shard-length/state-structure messages are not counted);
- the longest T one machine of ``--memory-gib`` (24) fits per layer and N: peak(T) extended
  linearly through the two longest measured T (``longest_T``), solved for the budget.

N = 1 is the plain layer on the whole sequence (no process group), the baseline. Every rank
runs with ``--threads`` threads; on a machine with fewer cores than N x threads the times
mostly measure contention, the memory and byte counts do not depend on it.

Run: ``fastweights bench context-parallel --world 1,2,4 --lengths 1024,2048,4096
--out benchmarks/results/context_parallel``. Writes its record (bench/record.py): results.csv,
longest_T.csv, results.md (the summary), meta.json (the command, machine and settings) and
lscpu.txt.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._commands import (
    UserError,
    command_line,
    parse_int_list,
    parse_mixer_spec,
    positive_int,
    user_errors,
)
from ..models.registry import build_mixer, check_mixer, mixer_names
from ..parallel import context_parallel_forward, counting, strategy_name
from .measure import PeakMemory, prepare_cpu_memory_accounting, time_call
from .record import Record, Table, add_out_arguments

FIELDS = ["mixer", "strategy", "world", "T", "shard_T", "time_s", "peak_bytes_per_rank",
          "comm_forward_bytes", "comm_backward_bytes", "comm_bytes_max_rank"]
GIB = 2**30


def shard_lengths(T: int, world: int, unit: int) -> list[int]:
    """T split into ``world`` contiguous shards, each a multiple of ``unit`` but the last,
    as equal as that allows."""
    blocks = T // unit
    base, extra = divmod(blocks, world)
    out = [(base + (r < extra)) * unit for r in range(world)]
    out[-1] += T - sum(out)
    if min(out) < 1:
        raise ValueError(f"T={T} is too short to give {world} shards of whole {unit}-token blocks")
    return out


def _unit(mixer: Any) -> int:
    return getattr(mixer, "block_size", None) or getattr(mixer, "segment_len", None) or 1


def _measure(step: Any, repeats: int, world: int) -> tuple[float, int | None, int, int]:
    """(median time, peak bytes, forward bytes, backward bytes) of ``step`` on this rank."""
    def synchronised_step() -> None:
        step()
        if world > 1:
            dist.barrier()  # the step ends when the slowest rank's does

    step()  # warm-up
    times = []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        times.append(time_call(synchronised_step, torch.device("cpu")))
    with PeakMemory(torch.device("cpu")) as peak:
        step()
    with counting() as traffic:
        step()
    return statistics.median(times), peak.peak, traffic.forward, traffic.backward


def _train_step(mixer: Any, x: torch.Tensor, world: int) -> None:
    """Forward and backward of one layer on this rank's shard (the whole sequence for N = 1)."""
    y = mixer(x)[0] if world == 1 else context_parallel_forward(mixer, x)[0]
    y.sum().backward()
    mixer.zero_grad(set_to_none=True)
    x.grad = None


def init_rank(rank: int, world: int, port: int, opts: dict) -> None:
    """A benchmark rank's set-up: ``opts["threads"]`` threads, memory accounting, and for
    N > 1 the gloo group on 127.0.0.1:``port`` with ``opts["timeout"]`` seconds."""
    torch.set_num_threads(opts["threads"])
    prepare_cpu_memory_accounting()
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=opts["timeout"]))


def finish_rank(rank: int, world: int, rows: list, path: str) -> None:
    """A benchmark rank's end: rank 0 hands ``rows`` to the parent process as JSON in ``path``
    (a temporary file of ``run_worlds``, not a record); for N > 1 the models
    are collected (FSDP's hold reference cycles) and every rank passes a barrier before the
    group goes (gloo work still alive at interpreter exit can abort the process: seen once as a
    SIGABRT of rank 1 under a loaded test run)."""
    if rank == 0:
        Path(path).write_text(json.dumps(rows))
    if world > 1:
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def _rank_main(rank: int, world: int, port: int, opts: dict, path: str) -> None:
    init_rank(rank, world, port, opts)
    rows = []
    for label, name, options in opts["mixers"]:
        for T in opts["lengths"]:
            torch.manual_seed(0)
            mixer = build_mixer(name, opts["d_model"], opts["n_heads"], **options)
            lengths = shard_lengths(T, world, _unit(mixer))
            x = torch.randn(opts["batch"], lengths[rank], opts["d_model"], requires_grad=True)

            step = functools.partial(_train_step, mixer, x, world)
            t, peak, fwd, bwd = _measure(step, opts["repeats"], world)
            mine = (t, peak, fwd, bwd)
            every = [mine]
            if world > 1:
                every = [None] * world
                dist.all_gather_object(every, mine)
            if rank == 0:
                peaks = [e[1] for e in every]
                rows.append({
                    "mixer": label, "strategy": "single" if world == 1 else strategy_name(mixer),
                    "world": world, "T": T, "shard_T": max(lengths),
                    "time_s": max(e[0] for e in every),
                    "peak_bytes_per_rank": None if None in peaks else max(peaks),
                    "comm_forward_bytes": sum(e[2] for e in every),
                    "comm_backward_bytes": sum(e[3] for e in every),
                    "comm_bytes_max_rank": max(e[2] + e[3] for e in every),
                })
    finish_rank(rank, world, rows, path)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worlds(rank_main: Any, worlds: list[int], opts: dict) -> list[dict]:
    """The rows rank 0 of every world size in ``worlds`` measured: ``rank_main(rank, world,
    port, opts, path)`` runs in this process for N = 1, else in N spawned processes (gloo on
    127.0.0.1), and rank 0 writes its rows as JSON to ``path`` (in a temporary folder)."""
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="fastweights-ranks-") as scratch:
        for world in worlds:
            path = str(Path(scratch) / f"rows_{world}.json")
            if world == 1:
                rank_main(0, 1, 0, opts, path)
            else:
                mp.spawn(rank_main, args=(world, _free_port(), opts, path), nprocs=world,
                         join=True)
            rows += json.loads(Path(path).read_text())
    return rows


def longest_T(rows: list[dict], budget: float) -> list[dict]:
    """Per (mixer, world): the T where peak(T), extended linearly through the two longest
    measured T (the asymptotic slope), reaches ``budget`` bytes; None when memory was not
    measured or did not grow. An extrapolation: quadratic parts beyond the measured range
    (softmax without a flash kernel) make it optimistic."""
    out = []
    for mixer, world in sorted({(r["mixer"], r["world"]) for r in rows}):
        pts = sorted((r["T"], r["peak_bytes_per_rank"]) for r in rows
                     if r["mixer"] == mixer and r["world"] == world and r["peak_bytes_per_rank"])
        T_max = None
        if len(pts) >= 2:
            (T1, p1), (T2, p2) = pts[-2:]
            if p2 > p1:
                T_max = int(T2 + (budget - p2) * (T2 - T1) / (p2 - p1))
        out.append({"mixer": mixer, "world": world, "longest_T": T_max})
    return out


def _summary(rows: list[dict], longest: list[dict], budget_gib: float) -> str:
    lines = ["| mixer | strategy | N | T | time/step (s) | peak/rank (MiB) | comm/step (KiB, fwd+bwd) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "-" if r["peak_bytes_per_rank"] is None else f"{r['peak_bytes_per_rank'] / 2**20:.1f}"
        comm = (r["comm_forward_bytes"] + r["comm_backward_bytes"]) / 1024
        lines.append(f"| {r['mixer']} | {r['strategy']} | {r['world']} | {r['T']} | "
                     f"{r['time_s']:.4f} | {peak} | {comm:.1f} |")
    lines += ["", f"Longest T per layer in {budget_gib:g} GiB (fitted, extrapolated):", "",
              "| mixer | N | longest T |", "|---|---|---|"]
    lines += [f"| {r['mixer']} | {r['world']} | {r['longest_T'] if r['longest_T'] else '-'} |"
              for r in longest]
    return "\n".join(lines) + "\n"


def check(mixers: list[tuple[str, str, dict]], lengths: list[int], worlds: list[int], *,
          d_model: int, n_heads: int) -> None:
    """Every mixer ``(label, name, options)`` builds and splits every length over every world
    size; ValueError (or TypeError) starting with the label of the first that does not."""
    for label, name, options in mixers:
        try:
            check_mixer(name, d_model, n_heads, **options)
            with torch.device("meta"):
                unit = _unit(build_mixer(name, d_model, n_heads, **options))
            for T in lengths:
                for world in worlds:
                    shard_lengths(T, world, unit)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{label}: {exc}") from None


def run_context_parallel(mixers: list[tuple[str, str, dict]], lengths: list[int], worlds: list[int], out: Path,
        *, d_model: int = 256, n_heads: int = 4, batch: int = 1, repeats: int = 3,
        threads: int = 1, memory_gib: float = 24.0, timeout: float = 600.0,
        command: str = "", overwrite: bool = False) -> list[dict]:
    """Measure every mixer ``(label, name, options)`` at every length on every world size (one
    group of processes per size); writes the record (results.csv, longest_T.csv, results.md,
    meta.json with ``command``, lscpu.txt) into ``out``, claimed first (refused if it holds
    anything unless ``overwrite``), prints the summary, returns the rows."""
    rec = Record(out, NAME, overwrite=overwrite, files=("longest_T.csv",))
    opts = {"mixers": mixers, "lengths": lengths, "d_model": d_model, "n_heads": n_heads,
            "batch": batch, "repeats": repeats, "threads": threads, "timeout": timeout}
    rows = run_worlds(_rank_main, worlds, opts)
    rows.sort(key=lambda r: (r["mixer"], r["T"], r["world"]))
    longest = longest_T(rows, memory_gib * GIB)
    summary = _summary(rows, longest, memory_gib)
    meta = rec.meta(command, **{k: v for k, v in opts.items() if k != "mixers"},
                    mixers=[label for label, _, _ in mixers], worlds=worlds,
                    memory_gib=memory_gib)
    rec.write(Table(rows, FIELDS), meta, markdown=summary,
              files={"longest_T.csv": Table(longest, ["mixer", "world", "longest_T"])})
    print(summary)
    return rows


NAME = "context-parallel"
DESCRIPTION = ("One layer's training step (forward + backward) on one sequence of T tokens split "
               "over N processes (gloo, CPU), for N in --world and T in --lengths: time per "
               "step, peak memory per rank, bytes communicated per layer, and the longest T one "
               "machine of --memory-gib fits. Writes its record (results.csv, longest_T.csv, "
               "results.md, meta.json, lscpu.txt) into --out.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", default="1,2,4", help="comma-separated process counts N")
    p.add_argument("--lengths", default="1024,2048,4096", help="comma-separated total T")
    p.add_argument("--mixers", default=",".join(mixer_names()),
                   help="comma-separated mixer specs (name or name:opt=value)")
    p.add_argument("--d-model", type=positive_int, default=256)
    p.add_argument("--n-heads", type=positive_int, default=4)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    p.add_argument("--memory-gib", type=float, default=24.0, help="machine budget for longest T")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    add_out_arguments(p, required=True)


def run(args: argparse.Namespace) -> int:
    worlds = parse_int_list("--world", args.world)
    lengths = parse_int_list("--lengths", args.lengths)
    mixers = [(m, *parse_mixer_spec("--mixers", m)) for m in args.mixers.split(",") if m]
    if not mixers:
        raise UserError(f"--mixers: no mixer given in {args.mixers!r}")
    with user_errors((TypeError, ValueError), prefix="--mixers "):
        check(mixers, lengths, worlds, d_model=args.d_model,
                               n_heads=args.n_heads)
    run_context_parallel(mixers, lengths, worlds, args.out, d_model=args.d_model,
                         n_heads=args.n_heads, batch=args.batch, repeats=args.repeats,
                         threads=args.threads, memory_gib=args.memory_gib, timeout=args.timeout,
                         command=command_line(["fastweights", "bench", NAME], args),
                         overwrite=args.overwrite)
    return 0
